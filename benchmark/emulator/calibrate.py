"""Calibrate the ``cpu-smollm2`` emulator profile against the real SGLang CPU server.

1. Warm-up: one request of each shape, so first-use costs do not enter the fit.
2. Fitting workload (synchronised microbenchmarks on the real server, random token ids):
   - prefill: single requests with one output token, prompts of 16 .. 2,048 tokens (two each),
     and batches of 4 sent at once;
   - decode: B ∈ {1, 2, 4, 8} requests sent at once with 64- and 512-token prompts and 24 output
     tokens; the median inter-token latency of each run is one decode sample.
   - prefill into a running batch: single requests of 128 and 384 tokens sent while R ∈ {1, 2, 4}
     requests decode (on two cores the running requests' output path slows the pass down).
   The decode samples fit ``decode_base_s + per_request·B + per_kv_token·KV``; TTFT samples, less
   the expected wait for the decode step in flight (half a fitted step), fit ``prefill_base_s +
   per_running_request·R + per_request·B + per_token·Σn + attention·Σn²/2`` (least squares,
   non-negative).
3. Validation workload, NOT used for fitting: a closed loop at concurrency 4, 16 requests, prompts
   of 100..400 tokens and 16..48 output tokens, on the real server and on an emulated worker with
   the fitted profile (real time, ``--time-scale 1``). Prints median TTFT and TPOT of both and the
   relative error (target: within 20%), writes ``results/calibration.json`` and, with
   ``--write-profile``, the profile YAML.

Both servers are driven by ``omniinfer bench``'s own closed loop (``omniinfer.bench.runner``).
Timing: run it on a quiet machine; the script records the load average before and after.

    python benchmark/emulator/calibrate.py --write-profile            # starts the real server
    python benchmark/emulator/calibrate.py --real-url http://127.0.0.1:31000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from omniinfer.bench.client import BACKENDS, RequestResult, send  # noqa: E402
from omniinfer.bench.runner import run_closed_loop  # noqa: E402
from omniinfer.bench.workloads import BenchRequest, TokenSource  # noqa: E402
from omniinfer.emulator.process import EmulatorProcess  # noqa: E402
from omniinfer.emulator.profile import load_profile, profile_from_dict  # noqa: E402

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROFILE_PATH = ROOT / "python" / "omniinfer" / "emulator" / "profiles" / "cpu-smollm2.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "calibration.json"
MAX_TOTAL_TOKENS = 16384
VOCAB = 49152  # SmolLM2 config.json
SPECIAL = frozenset(range(17))  # SmolLM2's added special tokens sit at ids 0..16

BACKGROUND_PROMPT, BACKGROUND_OUTPUT = 300, 48  # the decoding requests of the running-batch probes

_tokens = TokenSource(VOCAB, SPECIAL, seed=7)
_next_key = [0]


def make_requests(shapes: Sequence[tuple[int, int]]) -> list[BenchRequest]:
    """Fresh random-id prompts (never a cache hit) of the given (prompt, output) lengths."""
    out = []
    for i, (n_in, n_out) in enumerate(shapes):
        _next_key[0] += 1
        out.append(BenchRequest(i, n_in, n_out, input_ids=tuple(_tokens.block(_next_key[0], n_in))))
    return out


def flush(url: str) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=30).read()
    except OSError:
        pass


def run(url: str, requests: list[BenchRequest], concurrency: int) -> list[RequestResult]:
    results, _ = asyncio.run(run_closed_loop(url, requests, concurrency, "sglang", progress=False,
                                             timeout_s=900))
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} request(s) failed against {url}: {bad[0].error}")
    return results


def warm_up(url: str) -> None:
    for shapes in ([(64, 4)], [(1024, 4)], [(64, 4)] * 4):
        run(url, make_requests(shapes), len(shapes))


def fitting_measurements(url: str) -> dict:
    """Synchronised microbenchmarks; returns raw samples for the fit."""
    prefill = []
    for n in (16, 128, 512, 1024, 2048):
        for _ in range(2):
            flush(url)
            res = run(url, make_requests([(n, 1)]), 1)[0]
            prefill.append({"batch": 1, "tokens": [n], "ttft": res.ttft})
    for n in (128, 512):
        flush(url)
        results = run(url, make_requests([(n, 1)] * 4), 4)
        # Sent at once, they share one prefill batch: its time is the last first token.
        prefill.append({"batch": 4, "tokens": [n] * 4, "ttft": max(r.ttft for r in results)})
    decode = []
    for n_in in (64, 512):
        for batch in (1, 2, 4, 8):
            flush(url)
            results = run(url, make_requests([(n_in, 24)] * batch), batch)
            itl = [x for r in results for x in r.itl[2:]]  # skip steps next to the prefill
            kv = batch * (n_in + 12)  # mid-decode KV
            decode.append({"batch": batch, "kv": kv, "tpot": statistics.median(itl)})
            print(f"  decode B={batch} prompt={n_in}: median ITL {decode[-1]['tpot'] * 1e3:.1f} ms", flush=True)
    for running in (1, 2, 4):
        flush(url)
        for sample in asyncio.run(_prefill_while_decoding(url, running)):
            prefill.append(sample)
            print(f"  prefill {sample['tokens'][0]} tokens with {running} decoding: TTFT {sample['ttft'] * 1e3:.0f} ms",
                  flush=True)
    return {"prefill": prefill, "decode": decode}


async def _prefill_while_decoding(url: str, running: int) -> list[dict]:
    """Probe requests arriving while ``running`` requests decode; one sample per probe."""
    api = BACKENDS["sglang"]
    samples = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        background = [asyncio.create_task(send(session, url, api, r, lambda r: "", 0.0))
                      for r in make_requests([(BACKGROUND_PROMPT, BACKGROUND_OUTPUT)] * running)]
        await asyncio.sleep(4.0)  # past the background's own prefill
        for n in (128, 384, 128, 384):
            probe = await send(session, url, api, make_requests([(n, 1)])[0], lambda r: "", 0.0)
            if not probe.ok or probe.ttft is None:
                raise SystemExit(f"probe failed against {url}: {probe.error}")
            samples.append({"batch": 1, "tokens": [n], "ttft": probe.ttft, "running": running})
            await asyncio.sleep(0.3)
        finished = await asyncio.gather(*background)
    if any(r.output_tokens < BACKGROUND_OUTPUT for r in finished):
        raise SystemExit("background requests ended before the probes: raise their output length")
    return samples


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0 (drop the most negative column until none is negative)."""
    active = list(range(a.shape[1]))
    while True:
        x_active, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x_active >= 0).all():
            x = np.zeros(a.shape[1])
            x[active] = x_active
            return x
        active.pop(int(np.argmin(x_active)))


def fit(samples: dict) -> dict[str, float]:
    rows, ys = [], []
    for s in samples["decode"]:
        rows.append([1.0, s["batch"], s["kv"]])
        ys.append(s["tpot"])
    d = nnls(np.array(rows), np.array(ys))
    rows, ys = [], []
    for s in samples["prefill"]:
        tokens, running = s["tokens"], s.get("running", 0)
        wait = 0.0
        if running:  # the probe waited on average half of the decode step in flight
            wait = 0.5 * (d[0] + d[1] * running + d[2] * running * (BACKGROUND_PROMPT + BACKGROUND_OUTPUT // 2))
        rows.append([1.0, running, s["batch"], sum(tokens), sum(n * n / 2.0 for n in tokens)])
        ys.append(max(s["ttft"] - wait, 0.0))
    p = nnls(np.array(rows), np.array(ys))
    return {
        "prefill_base_s": float(p[0]), "prefill_per_running_request_s": float(p[1]),
        "prefill_per_request_s": float(p[2]),
        "prefill_per_token_s": float(p[3]), "prefill_attention_s": float(p[4]),
        "decode_base_s": float(d[0]), "decode_per_request_s": float(d[1]),
        "decode_per_kv_token_s": float(d[2]),
    }


def validation_requests() -> list[BenchRequest]:
    """16 requests, prompts 100..400 tokens, outputs 16..48 tokens (seeded); not used for fitting."""
    import random

    rng = random.Random(12345)
    return make_requests([(rng.randint(100, 400), rng.randint(16, 48)) for _ in range(16)])


def medians(results: list[RequestResult]) -> dict[str, float]:
    return {
        "median_ttft_s": statistics.median(r.ttft for r in results if r.ttft is not None),
        "median_tpot_s": statistics.median(r.tpot for r in results if r.tpot is not None),
        "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in results),
    }


def profile_yaml(cost: dict[str, float], date: str) -> str:
    c = {k: f"{v:.6g}" for k, v in cost.items()}
    return f"""# Calibrated on this CPU against the real SGLang 0.5.23 serving SmolLM2-135M-Instruct (fp32,
# torch_native attention, --max-total-tokens {MAX_TOTAL_TOKENS}) by benchmark/emulator/calibrate.py on {date}.
# Every cost number below is a least-squares fit of that script's fitting workload; the script
# prints emulated-vs-real median TTFT/TPOT on a separate validation workload
# (results: benchmark/emulator/results/calibration.json).
name: cpu-smollm2
description: SmolLM2-135M-Instruct on the real SGLang CPU engine (2-core AVX2 box), fitted
model:
  model_path: SmolLM2-135M-Instruct      # the model the real server served
  model_type: llama                      # its config.json
  architectures: [LlamaForCausalLM]      # its config.json
  context_length: 8192                   # its config.json max_position_embeddings
  vocab_size: 49152                      # its config.json
  eos_token_id: 2                        # its config.json
  default_system_prompt: "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # its chat template
capacity:
  max_total_tokens: {MAX_TOTAL_TOKENS}   # the real server's --max-total-tokens
  chunked_prefill_size: 4096             # SGLang 0.5.23 default on this machine (server_info)
  max_prefill_tokens: 16384              # SGLang default (server_info)
  max_running_requests: 2048             # server_info effective_max_running_requests_per_dp
  new_token_ratio: 0.7                   # SGLang's initial new_token_ratio (schedule_conservativeness 1.0)
  radix_cache: true                      # SGLang default
  decode_radix_cache: false              # SGLang default (--disaggregation-decode-enable-radix-cache off)
cost:
  prefill_base_s: {c['prefill_base_s']}          # fitted: TTFT intercept (scheduler + HTTP + tokenizer)
  prefill_per_request_s: {c['prefill_per_request_s']}   # fitted: TTFT slope per request in a batch
  prefill_per_token_s: {c['prefill_per_token_s']}     # fitted: TTFT slope per prompt token
  prefill_attention_s: {c['prefill_attention_s']}     # fitted: TTFT slope per n²/2 (attention)
  prefill_per_running_request_s: {c['prefill_per_running_request_s']}  # fitted: TTFT slope per decoding request
  decode_base_s: {c['decode_base_s']}            # fitted: TPOT intercept
  decode_per_request_s: {c['decode_per_request_s']}    # fitted: TPOT slope per running request
  decode_per_kv_token_s: {c['decode_per_kv_token_s']}   # fitted: TPOT slope per KV token in the batch
  request_overhead_s: 0.0                # folded into prefill_base_s by the fit
transfer:
  kv_bytes_per_token: 92160              # 30 layers x 3 KV heads x 64 dim x 2 (K,V) x 4 B (fp32), config.json
  bandwidth_gb_s: 10.0                   # assumption: loopback copy on this box (PD does not run on CPU)
  latency_s: 0.001                       # assumption
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-url", default=None, help="a running real server (default: start one)")
    parser.add_argument("--write-profile", action="store_true", help=f"write {PROFILE_PATH.name}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    load_before = os.getloadavg()
    validation = validation_requests()
    server = None
    url = args.real_url
    if url is None:
        port = free_port()
        server = SGLangServer(cpu_server_command(MODEL, port, max_total_tokens=MAX_TOTAL_TOKENS), cpu_env(),
                              Path(tempfile.gettempdir()) / "calibrate-real-server.log", port).start()
        url = server.base_url
    try:
        t0 = time.time()
        print("warm-up ...", flush=True)
        warm_up(url)
        print("fitting workload on the real server ...", flush=True)
        samples = fitting_measurements(url)
        cost = fit(samples)
        print("fitted:", json.dumps(cost, indent=1))
        print("validation workload on the real server ...", flush=True)
        flush(url)
        real = medians(run(url, validation, 4))
    finally:
        if server is not None:
            server.stop()

    date = time.strftime("%Y-%m-%d")
    text = profile_yaml(cost, date)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu-smollm2.yaml"
        path.write_text(text)
        profile_from_dict(__import__("yaml").safe_load(text), str(path))  # validates
        print("validation workload on the emulator ...", flush=True)
        with EmulatorProcess(profile=str(path), time_scale=1.0,
                             log_path=Path(tmp) / "emulator.log") as emulator:
            emu = medians(run(emulator.url, validation, 4))
    err_ttft = emu["median_ttft_s"] / real["median_ttft_s"] - 1.0
    err_tpot = emu["median_tpot_s"] / real["median_tpot_s"] - 1.0
    print()
    print(f"{'validation (not fitted)':<26}{'real':>10}{'emulated':>10}{'error':>9}")
    print(f"{'median TTFT (ms)':<26}{real['median_ttft_s'] * 1e3:>10.1f}{emu['median_ttft_s'] * 1e3:>10.1f}{err_ttft:>+9.1%}")
    print(f"{'median TPOT (ms)':<26}{real['median_tpot_s'] * 1e3:>10.1f}{emu['median_tpot_s'] * 1e3:>10.1f}{err_tpot:>+9.1%}")
    print(f"{'mean prompt tokens':<26}{real['mean_prompt_tokens']:>10.1f}{emu['mean_prompt_tokens']:>10.1f}")
    ok = abs(err_ttft) <= 0.20 and abs(err_tpot) <= 0.20
    print("within 20%:", "yes" if ok else "NO")
    result = {
        "date": date, "wall_s": time.time() - t0, "fitted_cost": cost, "fitting_samples": samples,
        "validation_workload": {"num_requests": 16, "concurrency": 4, "input_len": "100..400",
                                "output_len": "16..48", "seed": 12345},
        "load_average_before": load_before, "load_average_at_end": os.getloadavg(),
        "real": real, "emulated": emu, "error_median_ttft": err_ttft, "error_median_tpot": err_tpot,
        "within_20_percent": ok,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output}")
    if args.write_profile:
        PROFILE_PATH.write_text(text)
        load_profile(PROFILE_PATH)
        print(f"wrote {PROFILE_PATH}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
