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
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from omniinfer.attn import evaluator, text
from omniinfer.attn.pattern import load
from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

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
    p.add_argument("--out", type=Path, default=HERE / "results" / "admission.json")
    return p.parse_args(argv)


def _post(url: str, body: dict[str, Any], timeout: float = 3600.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def _running(base_url: str) -> int:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/loads", timeout=10) as reply:
            loads = json.loads(reply.read())
    except OSError:
        return 0
    rows = loads.get("loads", [loads]) if isinstance(loads, dict) else loads
    return sum(int(r.get("num_running_reqs", 0)) for r in rows if isinstance(r, dict))


def burst(base_url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Send every prompt at once; sample the running count until all are done."""
    results: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = _post(f"{base_url}/generate", {
            "input_ids": prompts[i],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
        })

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    began = time.perf_counter()
    for t in threads:
        t.start()
    peak, samples = 0, []
    while any(t.is_alive() for t in threads):
        running = _running(base_url)
        peak = max(peak, running)
        samples.append(running)
        time.sleep(0.5)
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"peak_running": peak, "seconds": seconds, "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds, "running_samples": samples}


def run_server(args: argparse.Namespace, prompts: list[list[int]], extra: list[str],
               log: Path) -> dict[str, Any]:
    port = free_port()
    extra = ["--chunked-prefill-size", str(args.chunked_prefill_size), *extra]
    command = cpu_server_command(args.model, port, args.max_total_tokens, extra_args=extra)
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=900) as server:
        result = burst(server.base_url, prompts, args.new_tokens)
        if "--omni-attn-pattern" in extra:
            with urllib.request.urlopen(f"{server.base_url}/omni/attn", timeout=10) as reply:
                result["omni_attn"] = json.loads(reply.read())
            pattern = result["omni_attn"].get("pattern", {})
            pattern["model"] = Path(pattern.get("model", "")).name  # no local paths in results
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
    baseline = run_server(args, prompts, [], work / "baseline.log")
    omni = run_server(args, prompts, ["--omni-attn-pattern", str(args.pattern)],
                      work / "omni.log")
    summary = {
        "model": str(args.model.name),
        "context": args.context,
        "max_total_tokens": args.max_total_tokens,
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "chunked_prefill_size": args.chunked_prefill_size,
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
