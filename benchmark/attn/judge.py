"""Judge layer patterns on texts: the relative perplexity increase per text, ± standard error.

A pattern file (``--patterns``, comma list of paths), ``first-K`` (the first K layers) or
``layers:A+B+...`` (those layer ids, e.g. a shipped pattern with some layers taken out) is
scored on whole texts (``--texts``, shipped names) at one context, several windows each, by the
masked evaluator on the real model, beside the pattern's KV saving at that context. Use it on
kinds of text a search never read. Prints a table and writes ``--out`` (JSON); every score is
cached beside it, so a rerun with more patterns only scores the new ones.

    python benchmark/attn/judge.py --texts kjv_exodus,licences,gsm8k_qa --context 2048 \\
        --windows 4 --patterns python/omniinfer/attn/patterns/smollm2-135m.json,first-16,first-14
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

# same folder: the search's cached scoring
from generalise import REFERENCE_DIR, lazy_scores, windows_of
from tqdm import tqdm

from omniinfer.attn import evaluator, pattern, text
from omniinfer.attn.baselines import first_k
from omniinfer.attn.objective import Genome, from_layers

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--texts", default="kjv_exodus,licences,gsm8k_qa")
    p.add_argument("--patterns", default="python/omniinfer/attn/patterns/smollm2-135m.json,"
                                         "first-16,first-14")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=4, help="per text")
    p.add_argument("--sink", type=int, default=None, help="default: the first pattern file's")
    p.add_argument("--recent", type=int, default=None, help="default: the first pattern file's")
    p.add_argument("--max-drop", type=float, default=0.01, help="the bound reported against")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--reference-dir", type=Path, default=REFERENCE_DIR,
                   help="where the uncompressed model's scores per window set are kept")
    p.add_argument("--out", type=Path, default=HERE / "results" / "judge.json")
    return p.parse_args(argv)


def resolve(spec: str, num_layers: int) -> tuple[Genome, pattern.Pattern | None]:
    """``first-K``, ``layers:A+B+...`` or a pattern file: the genome and the loaded pattern
    (None unless a file)."""
    if spec.startswith("first-"):
        return first_k(int(spec.removeprefix("first-")), num_layers), None
    if spec.startswith("layers:"):
        try:
            layers = [int(i) for i in spec.removeprefix("layers:").split("+")]
        except ValueError:
            raise SystemExit(f"{spec}: layer ids must be integers joined by '+'") from None
        if not layers or any(not 0 <= i < num_layers for i in layers):
            raise SystemExit(f"{spec}: layer ids must lie in 0..{num_layers - 1}")
        return from_layers(layers, num_layers), None
    loaded = pattern.load(Path(spec))
    return loaded.mask, loaded


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = [n for n in args.texts.split(",") if n]
    unknown = [n for n in texts if n not in text.SHIPPED]
    if unknown:
        raise SystemExit(f"unknown texts {unknown}; shipped: {sorted(text.SHIPPED)}")
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = evaluator.load_model(args.model)
    num_layers = int(model.config.num_hidden_layers)
    specs = [s for s in args.patterns.split(",") if s]
    patterns = {s: resolve(s, num_layers) for s in specs}
    files = [loaded for _, loaded in patterns.values() if loaded is not None]
    sink = args.sink if args.sink is not None else (files[0].sink if files else 128)
    recent = args.recent if args.recent is not None else (files[0].recent if files else 384)
    texts_id = hashlib.sha1(",".join(texts).encode()).hexdigest()[:6]
    cache_path = args.out.with_name(
        f"{args.out.stem}-scores-{texts_id}-{args.windows}x{args.context}-sink{sink}"
        f"-recent{recent}.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cache = lazy_scores(cache_path, lambda: evaluator.TextSetEvaluator(
        model, windows_of(tokenizer, texts, "all", args.context, args.windows), sink, recent,
        args.reference_dir))
    rows = {spec: cache.get(genome) for spec, (genome, _) in
            tqdm(patterns.items(), desc="patterns", unit="pattern")}
    print(f"context {args.context}, sink {sink} + recent {recent}, {args.windows} windows per "
          f"text; relative perplexity increase, % ± s.e. (bound {args.max_drop * 100:.0f} %)")
    print(f"{'pattern':<44} {'L':>3} {'KV sav':>7}" + "".join(f" {n[:13]:>14}" for n in texts))
    for spec, record in rows.items():
        genome = patterns[spec][0]
        cells = "".join(f" {record['texts'][n]['drop'] * 100:>+7.2f}±"
                        f"{record['texts'][n]['drop_stderr'] * 100:.2f}" for n in texts)
        print(f"{Path(spec).name[:44]:<44} {sum(genome):>3} {record['kv_saved_fraction'] * 100:>6.1f}%"
              + cells)
    result = {"model": args.model.name, "context": args.context, "sink": sink, "recent": recent,
              "windows_per_text": args.windows, "texts": texts, "max_drop": args.max_drop,
              "patterns": {spec: {"layers": [i for i, b in enumerate(patterns[spec][0]) if b],
                                  "kv_saved_fraction": rows[spec]["kv_saved_fraction"],
                                  "worst_drop": rows[spec]["drop"],
                                  "worst_text": rows[spec]["worst_text"],
                                  "texts": {n: rows[spec]["texts"][n] for n in texts}}
                           for spec in specs}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
