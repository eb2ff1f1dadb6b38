"""Calibrate the ``cpu-smollm2`` emulator profile against the real SGLang CPU server.

1. Fitting workload (synchronised microbenchmarks on the real server):
   - prefill: single requests, one output token, prompts of 16, 256 and 1,024 tokens;
   - batched prefill + decode: B ∈ {1, 4} requests sent at once (64-token prompts, 16 output
     tokens), and one 1,024-token prompt at B = 1 for the KV-length term.
   TTFT samples fit ``prefill_base_s + per_request·B + per_token·n + attention·Σn²/2``; median TPOT
   per run fits ``decode_base_s + per_request·B + per_kv_token·KV`` (least squares, non-negative).
2. Validation workload, NOT used for fitting: a closed loop at concurrency 4, 12 requests, prompts
   of 99..300 tokens and 7..24 output tokens, on the real server and on an emulated worker with
   the fitted profile (real time, ``--time-scale 1``). Prints median TTFT and TPOT of both and the
   relative error (target: within 20%), writes ``results/calibration.json`` and, with
   ``--write-profile``, the profile YAML.

    python benchmark/emulator/calibrate.py --write-profile            # starts the real server
    python benchmark/emulator/calibrate.py --real-url http://127.0.0.1:31000
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from omniinfer.emulator.profile import load_profile, profile_from_dict  # noqa: E402

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROFILE_PATH = ROOT / "python" / "omniinfer" / "emulator" / "profiles" / "cpu-smollm2.yaml"
RESULTS = Path(__file__).resolve().parent / "results" / "calibration.json"
MAX_TOTAL_TOKENS = 16384


@dataclasses.dataclass
class BenchRequest:
    index: int
    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclasses.dataclass
class Result:
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def random_text(tokenizer, num: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts cut from tinyshakespeare at random offsets; lengths uniform in [ratio·len, len]."""
    rng = random.Random(seed)
    ids = _corpus_ids(tokenizer)
    out = []
    for i in range(num):
        n_in = rng.randint(max(1, int(input_len * ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * ratio)), output_len)
        start = rng.randrange(0, len(ids) - n_in)
        prompt = tokenizer.decode(ids[start : start + n_in])
        out.append(BenchRequest(i, prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n_out))
    return out


_CORPUS: list[int] = []


def _corpus_ids(tokenizer) -> list[int]:
    if not _CORPUS:
        text = (ROOT / "python" / "omniinfer" / "data" / "text" / "tinyshakespeare.txt").read_text()[:400_000]
        _CORPUS.extend(tokenizer.encode(text, add_special_tokens=False))
    return _CORPUS


async def _one(session: aiohttp.ClientSession, url: str, req: BenchRequest) -> Result:
    """POST /generate streaming with ignore_eos; TTFT at the first token, E2E at [DONE]."""
    result = Result(req.prompt_tokens)
    body = {"text": req.prompt, "stream": True,
            "sampling_params": {"max_new_tokens": req.output_tokens, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    async with session.post(f"{url}/generate", json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return result
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                result.error = str(event["error"])[:200]
                return result
            produced = int(event["meta_info"]["completion_tokens"])
            if produced > 0 and result.ttft is None:
                result.ttft = time.perf_counter() - start
            result.output_tokens = produced
            result.prompt_tokens = int(event["meta_info"]["prompt_tokens"])
    result.e2e = time.perf_counter() - start
    return result


async def _closed_loop(url: str, requests: list[BenchRequest], concurrency: int) -> list[Result]:
    queue = list(reversed(requests))
    results: list[Result] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:

        async def worker() -> None:
            while queue:
                results.append(await _one(session, url, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def flush(url: str) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=30).read()
    except OSError:
        pass


def run(url: str, requests: list[BenchRequest], concurrency: int) -> list[Result]:
    results = asyncio.run(_closed_loop(url, requests, concurrency))
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} request(s) failed against {url}: {bad[0].error}")
    return results


def renumber(requests: list[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(i, r.prompt, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)]


def fitting_measurements(url: str, tokenizer, seed: int = 1) -> dict:
    """Synchronised microbenchmarks; returns raw samples for the fit."""
    prefill = []
    for n in (16, 256, 1024):
        for rep in range(2):
            flush(url)
            req = random_text(tokenizer, 1, n, 1, 1.0, seed + 100 * n + rep)
            res = run(url, req, 1)[0]
            prefill.append({"batch": 1, "tokens": [req[0].prompt_tokens], "ttft": res.ttft})
    decode = []
    for batch, n_in in ((1, 64), (4, 64), (1, 1024)):
        flush(url)
        reqs = renumber(random_text(tokenizer, batch, n_in, 16, 1.0, seed + 7 * batch + n_in))
        results = run(url, reqs, batch)
        for r in results:
            prefill.append({"batch": batch, "tokens": [q.prompt_tokens for q in reqs], "ttft": r.ttft})
        tpots = [r.tpot for r in results if r.tpot is not None]
        kv = sum(q.prompt_tokens for q in reqs) + batch * 8  # mid-decode KV
        decode.append({"batch": batch, "kv": kv, "tpot": statistics.median(tpots)})
    return {"prefill": prefill, "decode": decode}


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
    for s in samples["prefill"]:
        tokens = s["tokens"]
        rows.append([1.0, s["batch"], sum(tokens), sum(n * n / 2.0 for n in tokens)])
        ys.append(s["ttft"])
    p = nnls(np.array(rows), np.array(ys))
    rows, ys = [], []
    for s in samples["decode"]:
        rows.append([1.0, s["batch"], s["kv"]])
        ys.append(s["tpot"])
    d = nnls(np.array(rows), np.array(ys))
    return {
        "prefill_base_s": float(p[0]), "prefill_per_request_s": float(p[1]),
        "prefill_per_token_s": float(p[2]), "prefill_attention_s": float(p[3]),
        "decode_base_s": float(d[0]), "decode_per_request_s": float(d[1]),
        "decode_per_kv_token_s": float(d[2]),
    }


def validation_requests(tokenizer) -> list[BenchRequest]:
    return random_text(tokenizer, 12, 300, 24, 0.33, seed=12345)


def medians(results) -> dict[str, float]:
    return {
        "median_ttft_s": statistics.median(r.ttft for r in results),
        "median_tpot_s": statistics.median(r.tpot for r in results if r.tpot is not None),
        "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in results),  # as the server counted them
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
  decode_base_s: {c['decode_base_s']}            # fitted: TPOT intercept
  decode_per_request_s: {c['decode_per_request_s']}    # fitted: TPOT slope per running request
  decode_per_kv_token_s: {c['decode_per_kv_token_s']}   # fitted: TPOT slope per KV token in the batch
  request_overhead_s: 0.0                # folded into prefill_base_s by the fit
transfer:
  kv_bytes_per_token: 92160              # 30 layers x 3 KV heads x 64 dim x 2 (K,V) x 4 B (fp32), config.json
  bandwidth_gb_s: 10.0                   # assumption: loopback copy on this box (PD does not run on CPU)
  latency_s: 0.001                       # assumption
"""


def start_emulator(profile_path: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omniinfer", "emulate-worker", "--profile", str(profile_path),
           "--port", str(port), "--time-scale", "1"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"emulator did not start; log: {log}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real-url", default=None, help="a running real server (default: start one)")
    parser.add_argument("--write-profile", action="store_true", help=f"write {PROFILE_PATH.name}")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    server = None
    url = args.real_url
    if url is None:
        port = free_port()
        server = SGLangServer(cpu_server_command(MODEL, port, max_total_tokens=MAX_TOTAL_TOKENS), cpu_env(),
                              Path(tempfile.gettempdir()) / "calibrate-real-server.log", port).start()
        url = server.base_url
    try:
        t0 = time.time()
        print("fitting workload on the real server ...", flush=True)
        samples = fitting_measurements(url, tokenizer)
        cost = fit(samples)
        print("fitted:", json.dumps(cost, indent=1))
        print("validation workload on the real server ...", flush=True)
        flush(url)
        real = medians(run(url, validation_requests(tokenizer), 4))
    finally:
        if server is not None:
            server.stop()

    date = time.strftime("%Y-%m-%d")
    text = profile_yaml(cost, date)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu-smollm2.yaml"
        path.write_text(text)
        profile_from_dict(__import__("yaml").safe_load(text), str(path))  # validates
        from omniinfer.launch import free_port as fp

        port = fp()
        print("validation workload on the emulator ...", flush=True)
        proc = start_emulator(path, port, Path(tmp) / "emulator.log")
        try:
            emu = medians(run(f"http://127.0.0.1:{port}", validation_requests(tokenizer), 4))
        finally:
            proc.terminate()
            proc.wait()
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
        "validation_workload": {"num_requests": 12, "concurrency": 4, "input_len": "99..300",
                                "output_len": "7..24", "seed": 12345},
        "load_average_at_end": os.getloadavg(),
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
