"""How evenly routers spread decode work over a real server's data-parallel ranks.

Starts one real PD pair on this CPU (SmolLM2-135M, fp32, KV over Mooncake's TCP transport), the
prefill and the decode server each with ``--dp-size 2`` (one OpenMP core per rank), and sends
the same open-loop workload through each router in turn (caches flushed between runs):

  omni:oas+dp        OmniProxy ``oas`` with ``--dp-aware`` (decode LPT over every rank)
  omni:oas           OmniProxy ``oas`` naming no rank (SGLang's own ``round_robin`` inside)
  smg:dp_min_token   smg 1.13 ``--dp-aware --dp-minimum-tokens-scheduler`` (its rank scheduler)
  smg:power_of_two   smg 1.13 ``--dp-aware``, ``power_of_two`` over the ranks

The workload: prompts of 40-400 tokens (windows of ``paradise_lost.txt``), output budgets
long-tailed (8 to 128 tokens, ``ignore_eos``), Poisson arrivals. The prefill server runs with
``SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1``: without it SGLang 0.5.23 fails every
request that names no prefill rank and whose bootstrap room is odd (docs/benchmarks.md). While a run lasts, the decode
server's ``/v1/loads`` is sampled every 0.25 s; the figures are SGLang's own: per-rank KV tokens
in use, the imbalance (max - min over the mean of the ranks, averaged over busy samples), the
busiest rank's share, and the requests' TPOT and end-to-end latency. Prints a table and writes
``results/dp_ranks.json``.

    python benchmark/pd/dp_ranks.py --requests 16 --rate 0.25 --seeds 1 2   # ~20 min on 2 cores
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

import omniinfer.data
from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.proxy.process import RouterProcess
from omniinfer.testbed.pd_servers import (
    SGLangRouterProcess,
    pd_server,
    router_args,
    started,
    wait_idle,
)

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
TEXT = (Path(omniinfer.data.__file__).parent / "text" / "paradise_lost.txt").read_text()
TARGETS = ("omni:oas+dp", "omni:oas", "smg:dp_min_token", "smg:power_of_two")
OUTPUTS = ((8, 0.45), (16, 0.3), (48, 0.17), (128, 0.08))  # budget, probability
SAMPLE_S = 0.25
FORCE_QUERY_ENV = "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK"


def _post(url: str, body: dict[str, Any], timeout: float = 900.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def _ranks(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/v1/loads", timeout=10) as r:
        return sorted(json.loads(r.read())["loads"], key=lambda e: e["dp_rank"])


def workload(requests: int, rate: float, seed: int) -> list[tuple[float, str, int]]:
    """(arrival second, prompt, output budget) of each request."""
    rng = random.Random(seed)
    budgets, weights = zip(*OUTPUTS, strict=True)
    out, now = [], 0.0
    for _ in range(requests):
        now += rng.expovariate(rate)
        chars = int(rng.uniform(40, 400) * 4.2)  # ~4.2 characters a token in this text
        start = rng.randrange(0, len(TEXT) - chars)
        out.append((now, TEXT[start:start + chars], rng.choices(budgets, weights)[0]))
    return out


def router_process(target: str, prefill: Any, decode: Any, logs: Path) -> Any:
    """A not yet started router of ``target`` in front of the pair."""
    kind, policy = target.split(":", 1)
    if kind == "omni":
        args = [*router_args([prefill, decode]), "--prefill-policy", "oas",
                "--decode-policy", "oas", "--model-path", str(MODEL),
                "--loads-poll-interval-secs", "1"]
        if policy.endswith("+dp"):
            args.append("--dp-aware")
        return RouterProcess(args, logs / f"{target.replace(':', '-')}.log")
    port = free_port()
    command = [sys.executable, "-m", "smg.launch_router", "--host", "127.0.0.1", "--port",
               str(port), *router_args([prefill, decode]), "--log-level", "warn",
               "--prometheus-port", str(free_port()), "--load-monitor-interval", "1",
               "--dp-aware"]
    if policy == "dp_min_token":
        command += ["--prefill-policy", "round_robin", "--decode-policy", "round_robin",
                    "--dp-minimum-tokens-scheduler"]
    else:
        command += ["--prefill-policy", policy, "--decode-policy", policy]
    return SGLangRouterProcess(command, dict(os.environ, HF_HUB_OFFLINE="1"),
                               logs / f"{target.replace(':', '-')}.log", port,
                               ready_timeout_s=180.0)


class Sampler(threading.Thread):
    """Reads the decode server's per-rank loads every ``SAMPLE_S`` until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples = url, []  # type: ignore[var-annotated]
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(SAMPLE_S):
            try:
                ranks = _ranks(self.url)
            except OSError:
                continue
            self.samples.append([(e["num_used_tokens"], e["num_running_reqs"]) for e in ranks])


def spread(samples: list[list[tuple[int, int]]]) -> dict[str, float]:
    """Imbalance of KV in use over the ranks, over samples where any rank decodes."""
    busy = [[used for used, _ in s] for s in samples if sum(running for _, running in s)]
    if not busy:
        return {"imbalance": float("nan"), "busiest_share": float("nan"), "samples": 0}
    imbalance = [(max(u) - min(u)) / (sum(u) / len(u)) for u in busy if sum(u)]
    share = [max(u) / sum(u) for u in busy if sum(u)]
    return {"imbalance": statistics.fmean(imbalance), "busiest_share": statistics.fmean(share),
            "samples": len(busy)}


def run_target(target: str, prefill: Any, decode: Any, jobs: list[tuple[float, str, int]],
               logs: Path) -> dict[str, Any]:
    for server in (prefill, decode):  # (its answer is plain text)
        urllib.request.urlopen(urllib.request.Request(server.base_url + "/flush_cache",
                                                      method="POST"), timeout=60).read()
    with router_process(target, prefill, decode, logs) as router:
        sampler = Sampler(decode.base_url)
        sampler.start()
        t0 = time.perf_counter()

        def one(job: tuple[float, str, int]) -> dict[str, float]:
            arrival, prompt, budget = job
            time.sleep(max(0.0, t0 + arrival - time.perf_counter()))
            sent = time.perf_counter()
            body = {"text": prompt, "sampling_params": {"temperature": 0.0, "ignore_eos": True,
                                                        "max_new_tokens": budget}}
            answer = _post(router.base_url + "/generate", body)
            done = time.perf_counter()
            return {"e2e": done - sent, "tokens": answer["meta_info"]["completion_tokens"],
                    "done": done - t0}

        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(tqdm(pool.map(one, jobs), total=len(jobs), desc=target, leave=False))
        sampler.stop_event.set()
        sampler.join()
    wait_idle(decode.base_url, 120)
    e2e = sorted(r["e2e"] for r in results)
    per_token = sorted(r["e2e"] / max(1, r["tokens"]) for r in results)
    return {**spread(sampler.samples), "makespan_s": max(r["done"] for r in results),
            "e2e_p50_s": statistics.median(e2e), "e2e_p90_s": e2e[int(0.9 * (len(e2e) - 1))],
            "s_per_token_p50": statistics.median(per_token), "requests": len(results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.25, help="arrivals a second (Poisson)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV tokens a rank holds")
    p.add_argument("--out", type=Path, default=HERE / "results" / "dp_ranks.json")
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="dp-ranks-"))
    dp = ["--dp-size", "2"]
    prefill = pd_server(MODEL, "prefill", logs, args.max_total_tokens, dp, "prefill-dp")
    decode = pd_server(MODEL, "decode", logs, args.max_total_tokens, dp, "decode-dp")
    for server in (prefill, decode):
        server.env = cpu_env(threads_bind="0|1")
    # SGLang 0.5.23's DP prefill fails a request that names no prefill rank when its
    # bootstrap room is odd (every plain-DP rank checks the room against attn_dp_rank 0); the
    # remedy its own message names, so that routers naming no rank are served too
    prefill.env[FORCE_QUERY_ENV] = "1"
    runs: dict[str, dict[str, Any]] = {t: {} for t in args.targets}
    with started([prefill, decode]):
        for seed in args.seeds:
            jobs = workload(args.requests, args.rate, seed)
            for target in args.targets:  # interleaved: every seed runs every target in turn
                runs[target][str(seed)] = run_target(target, prefill, decode, jobs, logs)
                print(target, seed, json.dumps(runs[target][str(seed)]), flush=True)
    rows = []
    for target, by_seed in runs.items():
        figures = list(by_seed.values())
        rows.append({"target": target, **{k: statistics.median(f[k] for f in figures)
                                           for k in ("imbalance", "busiest_share", "makespan_s",
                                                     "e2e_p50_s", "e2e_p90_s",
                                                     "s_per_token_p50")}})
    print(f"\n{'target':<20}{'imbalance':>10}{'busiest':>9}{'makespan':>10}{'E2E P50':>9}"
          f"{'E2E P90':>9}{'s/token':>9}   (medians over seeds {args.seeds})")
    for r in rows:
        print(f"{r['target']:<20}{r['imbalance']:>10.3f}{r['busiest_share']:>9.3f}"
              f"{r['makespan_s']:>10.1f}{r['e2e_p50_s']:>9.2f}{r['e2e_p90_s']:>9.2f}"
              f"{r['s_per_token_p50']:>9.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "rows": rows, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
