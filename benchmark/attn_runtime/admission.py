"""OmniAttn admission: concurrent long requests at one --max-total-tokens, with and without a pattern.

Starts the real SGLang CPU server twice on the same model and KV budget (``--max-total-tokens``):
once plain, once with ``--omni-attn-pattern``. Each gets the same burst of long requests
(``--context`` tokens each: prompt plus ``--new-tokens``); ``/v1/loads`` is sampled while they
run, and the peak of ``num_running_reqs`` is the number admitted at once. Also reports the
output-token throughput of the burst. Prints both counts and the ratio; writes JSON to --out.

Run: .venv/bin/python benchmark/attn_runtime/admission.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from burst import serve_burst

from omniinfer.attn import evaluator, text
from omniinfer.attn.pattern import load
from omniinfer.bench.records import write_results

HERE = Path(__file__).resolve().parent
SEARCHED = HERE.parents[1] / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--pattern", type=Path, default=SEARCHED,
                   help="pattern file; default: the packaged pattern the GA search found for "
                        "SmolLM2-135M (benchmark/attn/search_smollm2.py)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--requests", type=int, default=14)
    p.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="both servers; bounds the compressed pool's prefill transient to a chunk")
    p.add_argument("--server-args", default="",
                   help="more flags for both servers, one string (as --server-args=--disable-radix-cache)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "admission.json")
    return p.parse_args(argv)


def run_server(args: argparse.Namespace, prompts: list[list[int]], extra: list[str],
               log: Path) -> dict[str, Any]:
    result, status = serve_burst(args.model, args.max_total_tokens, args.chunked_prefill_size,
                                 extra, log, prompts, args.new_tokens)
    if status is not None:
        pattern = status.get("pattern", {})
        pattern["model"] = Path(pattern.get("model", "")).name  # no local paths in results
        result["omni_attn"] = status
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_len = args.context - args.new_tokens
    ids = tokenizer.encode(text.read("paradise_lost"))
    prompts = [ids[i * prompt_len : (i + 1) * prompt_len] for i in range(args.requests)]
    work = Path(tempfile.mkdtemp(prefix="attn-admission-"))
    pattern = load(args.pattern)
    both = args.server_args.split()
    baseline = run_server(args, prompts, both, work / "baseline.log")
    omni = run_server(args, prompts, [*both, "--omni-attn-pattern", str(args.pattern)],
                      work / "omni.log")
    summary = {
        "model": str(args.model.name),
        "context": args.context,
        "max_total_tokens": args.max_total_tokens,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
        "server_args": both,
        "pattern": {"sink": pattern.sink, "recent": pattern.recent,
                    "compressed_layers": list(pattern.compressed_layers),
                    "kv_saved_fraction": pattern.kv_saved_fraction(args.context)},
        "baseline": baseline,
        "omni_attn": omni,
        "admitted_ratio": omni["peak_running"] / max(1, baseline["peak_running"]),
        # What the memory alone allows: KV bytes per 2K request shrink by the saved fraction.
        "memory_bound_ratio": 1.0 / (1.0 - pattern.kv_saved_fraction(args.context)),
        "throughput_ratio": omni["output_tokens_per_s"] / baseline["output_tokens_per_s"],
    }
    print(f"admitted at once: baseline {baseline['peak_running']}, "
          f"omni-attn {omni['peak_running']}, ratio {summary['admitted_ratio']:.2f} "
          f"(memory bound of the pattern: {summary['memory_bound_ratio']:.2f})")
    print(f"output tokens/s: baseline {baseline['output_tokens_per_s']:.2f}, "
          f"omni-attn {omni['output_tokens_per_s']:.2f}, "
          f"ratio {summary['throughput_ratio']:.2f}")
    write_results(args.out, summary, indent=2)
    return summary


if __name__ == "__main__":
    main()
