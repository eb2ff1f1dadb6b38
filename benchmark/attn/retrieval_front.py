"""A retrieval-aware pattern front at one context: rank the layers on the search's data, judge
each prefix of the ranking on data the ranking never read, ship the largest one that holds.

1. Ranking (``omniinfer.attn.front.rank_layers``): each layer compressed alone, scored on the
   search halves of ``--search-texts`` (perplexity increase, worst text) and on passkey cases
   from ``--search-haystacks`` (search halves; the drop of the key's log-probability).
2. Front: for every ``k`` of ``--ks``, the ranking's first ``k`` layers and the first-``k``
   pattern, each judged by the worst perplexity increase over ``--judge-texts`` (whole texts,
   kinds the ranking never read) and the worst band's retrieval loss on cases from
   ``--judge-haystacks`` (held-out halves, other keys: seed + 1), both kinds, ``--judge-cases``
   per kind and haystack.
3. The largest ``k`` within ``--max-drop`` and ``--max-retrieval-drop`` is the shipped point;
   the next point says which bound binds. ``--write-pattern FILE`` writes it.

Before it starts, the script prints the passes it will run and, from one timed pass, how long
they take (a 2K pass of SmolLM2-135M takes about 11 s on two CPU cores: this is a run for a GPU,
``--device cuda``). Prints the front and writes ``--out`` (JSON) and a PNG beside it.

    python benchmark/attn/retrieval_front.py --device cuda --context 2048 --sink 128 \\
        --recent 384 --out benchmark/attn/results/retrieval_front_2k.json \\
        --write-pattern smollm2-135m-2k-retrieval.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

# same folder: the shipped texts' windows and the uncompressed passes kept on disk
from generalise import REFERENCE_DIR, windows_of
from tqdm import tqdm

from omniinfer.attn import evaluator, front, masks, passkey, retrieval
from omniinfer.attn.baselines import first_k
from omniinfer.attn.objective import Genome, from_layers
from omniinfer.attn.pattern import from_layers as pattern_from_layers
from omniinfer.bench.records import recorded_args, write_results

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
JUDGED_KINDS = ("alice,asyoulik,stb_truetype_h,kjv_exodus,licences,gsm8k_qa,python_datamodel,"
                "python_glossary")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--device", choices=evaluator.DEVICES, default="cpu")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=384)
    p.add_argument("--search-texts", default="paradise_lost,tinyshakespeare")
    p.add_argument("--search-windows", type=int, default=2, help="per search text")
    p.add_argument("--search-haystacks", default=f"{passkey.REPEATED_FILLER},tinyshakespeare")
    p.add_argument("--search-cases", type=int, default=5, help="per kind and search haystack")
    p.add_argument("--judge-texts", default=JUDGED_KINDS)
    p.add_argument("--judge-windows", type=int, default=4, help="per judged text")
    p.add_argument("--judge-haystacks", default=f"{passkey.REPEATED_FILLER},lcet10")
    p.add_argument("--judge-cases", type=int, default=5, help="per kind and judged haystack")
    p.add_argument("--ks", default="4,6,8,10,12,14,16",
                   help="front points: compressed layers, comma list")
    p.add_argument("--max-drop", type=float, default=0.01)
    p.add_argument("--max-retrieval-drop", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference-dir", type=Path, default=REFERENCE_DIR,
                   help="where the uncompressed model's scores per window set are kept")
    p.add_argument("--out", type=Path, default=HERE / "results" / "retrieval_front.json")
    p.add_argument("--write-pattern", type=Path, default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.ks = sorted({int(k) for k in args.ks.split(",") if k})
    return args


def _names(spec: str) -> list[str]:
    return [name for name in spec.split(",") if name]


def _judge(genome: Genome, ppl: evaluator.TextSetEvaluator, cases: retrieval.RetrievalCheck,
           sink: int, recent: int, context: int) -> front.Judged:
    scored = ppl.evaluate(genome)
    kept = cases.score(genome, sink, recent)
    return front.Judged(
        layers=tuple(i for i, on in enumerate(genome) if on),
        kv_saved=ppl.kv_saved_fraction(genome, context), ppl_drop=scored["drop"],
        worst_text=scored["worst_text"], retrieval_loss=kept["retrieval_loss_points"],
        worst_band=kept["retrieval_worst_band"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = evaluator.load_model(args.model, args.device)
    num_layers = model.config.num_hidden_layers
    if any(not 0 < k < num_layers for k in args.ks):
        raise SystemExit(f"--ks: each k in 1..{num_layers - 1} (one layer stays full)")
    search_ppl = evaluator.TextSetEvaluator(model, windows_of(
        tokenizer, _names(args.search_texts), "search", args.context, args.search_windows),
        args.sink, args.recent, args.reference_dir)
    search_cases = retrieval.RetrievalCheck(
        model, tokenizer, args.context, args.search_cases, _names(args.search_haystacks),
        part="search", seed=args.seed)
    judge_ppl = evaluator.TextSetEvaluator(model, windows_of(
        tokenizer, _names(args.judge_texts), "all", args.context, args.judge_windows),
        args.sink, args.recent, args.reference_dir)
    judge_cases = retrieval.RetrievalCheck(
        model, tokenizer, args.context, args.judge_cases, _names(args.judge_haystacks),
        part="heldout", seed=args.seed + 1)
    began = time.perf_counter()
    full_keys = [lp for _, lp in passkey.answer_scores(model, search_cases.cases, None)]
    per_pass = (time.perf_counter() - began) / len(search_cases.cases)
    ranking_passes = num_layers * (args.search_windows * len(search_ppl.texts)
                                   + len(search_cases.cases))
    front_passes = 2 * len(args.ks) * (args.judge_windows * len(judge_ppl.texts)
                                       + len(judge_cases.cases))
    print(f"passes: ranking {ranking_passes}, front {front_passes}; {per_pass:.2f} s per pass "
          f"measured: about {(ranking_passes + front_passes) * per_pass / 60:.0f} min", flush=True)

    ppl_drop, key_drop = [], []
    for layer in tqdm(range(num_layers), desc="ranking", disable=args.no_progress):
        genome = from_layers([layer], num_layers)
        ppl_drop.append(search_ppl.evaluate(genome)["drop"])
        windows = masks.windows_for(genome, args.sink, args.recent)
        mine = [lp for _, lp in passkey.answer_scores(model, search_cases.cases, windows)]
        key_drop.append(sum(f - m for f, m in zip(full_keys, mine, strict=True)) / len(mine))
    order = front.rank_layers(ppl_drop, key_drop)

    judged: dict[Genome, front.Judged] = {}  # a ranked prefix may be its first-k twin

    def judge(genome: Genome) -> front.Judged:
        if genome not in judged:
            judged[genome] = _judge(genome, judge_ppl, judge_cases, args.sink, args.recent,
                                    args.context)
        return judged[genome]

    points = [front.FrontPoint(k, judge(from_layers(order[:k], num_layers)),
                               judge(first_k(k, num_layers)))
              for k in tqdm(args.ks, desc="front", disable=args.no_progress)]
    shipped = front.shipped_point(points, args.max_drop, args.max_retrieval_drop)
    return {
        "args": recorded_args(args, ROOT),
        "num_layers": num_layers,
        "ranking": {"order": order, "ppl_drop": ppl_drop, "key_logprob_drop": key_drop},
        "full_retrieval": {"search": sum(search_cases.full_passed) / len(search_cases.cases),
                           "judged": sum(judge_cases.full_passed) / len(judge_cases.cases),
                           "judged_cases": len(judge_cases.cases)},
        "front": [{"k": p.k, "ranked": vars(p.ranked), "first_k": vars(p.first_k),
                   "ranked_beats_first_k": p.ranked.beats(p.first_k)} for p in points],
        "shipped_k": None if shipped is None else shipped.k,
        "binding": front.binding_bounds(points, shipped, args.max_drop, args.max_retrieval_drop),
        "seconds_per_pass": per_pass,
    }


def report(result: dict[str, Any], max_drop: float, max_loss: float) -> list[str]:
    lines = [f"full model retrieval: search {result['full_retrieval']['search']:.0%}, judged "
             f"{result['full_retrieval']['judged']:.0%} of "
             f"{result['full_retrieval']['judged_cases']} cases",
             f"ranking (cheapest first): {result['ranking']['order']}",
             "| k | KV saved | ranked: worst ppl (kind), retrieval loss (band) | first-k: worst "
             "ppl, retrieval loss | ranked beats first-k |", "|---|---|---|---|---|"]
    for point in result["front"]:
        r, f = point["ranked"], point["first_k"]
        lines.append(f"| {point['k']} | {r['kv_saved']:.1%} | {r['ppl_drop']:+.2%} "
                     f"({r['worst_text']}), {r['retrieval_loss']:.0f} ({r['worst_band']}) | "
                     f"{f['ppl_drop']:+.2%}, {f['retrieval_loss']:.0f} | "
                     f"{'yes' if point['ranked_beats_first_k'] else 'no'} |")
    shipped = result["shipped_k"]
    bounds = f"perplexity <= +{max_drop:.0%} and retrieval loss <= {max_loss:g} points"
    past = (f"past it {' and '.join(result['binding'])} binds" if result["binding"]
            else "no larger point was judged")
    lines.append(f"shipped point: {'none holds ' + bounds if shipped is None else f'k = {shipped}'}"
                 f"; {past}")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("ranked", "o-"), ("first_k", "s--")):
        saved = [p[name]["kv_saved"] * 100 for p in result["front"]]
        left.plot(saved, [p[name]["ppl_drop"] * 100 for p in result["front"]], style, label=name)
        right.plot(saved, [p[name]["retrieval_loss"] for p in result["front"]], style, label=name)
    left.set(xlabel="KV saved (%)", ylabel="worst perplexity increase (%)")
    right.set(xlabel="KV saved (%)", ylabel="worst band's retrieval loss (points)")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    for line in report(result, args.max_drop, args.max_retrieval_drop):
        print(line)
    write_results(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    if args.write_pattern is not None and result["shipped_k"] is not None:
        from transformers import AutoConfig

        k = result["shipped_k"]
        point = next(p for p in result["front"] if p["k"] == k)
        provenance = {
            "method": "benchmark/attn/retrieval_front.py: the retrieval-aware ranking's largest "
                      "prefix within both bounds on judged data",
            "context": args.context, "kv_saved_fraction": point["ranked"]["kv_saved"],
            "judged": {"texts": args.judge_texts, "haystacks": args.judge_haystacks,
                       "ppl_drop": point["ranked"]["ppl_drop"],
                       "retrieval_loss_points": point["ranked"]["retrieval_loss"]}}
        made = pattern_from_layers(point["ranked"]["layers"], AutoConfig.from_pretrained(
            args.model), args.sink, args.recent, args.model.name, provenance)
        made.save(args.write_pattern)
        print(f"wrote {args.write_pattern}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
