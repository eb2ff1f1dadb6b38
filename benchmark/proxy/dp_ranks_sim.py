"""Decode placement over many data-parallel ranks: OmniProxy's ``--dp-aware`` OAS against the
rank choices SGLang users have today, with the router's real decode policy in a simulated pool.

The paper's decode instance is DP64: one server of 64 ranks under DP attention, whose ranks step
together (the MoE all-to-all waits for the slowest), so a decode step costs what the busiest
rank's batch costs. This machine cannot run 64 ranks, so the ranks are simulated; the placement
is the real code: ``OASPolicy`` (``--decode-policy oas --dp-aware``) is created through the
policy registry and schedules every request over fake ``Worker`` objects with their rank count,
booked and released as the router's ``Booking`` does, and hears each rank's KV use every
``--poll-s`` as the router hears ``/v1/loads``. The peers, modelled after their documentation:

  round_robin   the router names no rank: SGLang's DP controller default (``round_robin``)
  min_tokens    smg 1.13 ``--dp-aware --dp-minimum-tokens-scheduler``: the rank with the fewest
                KV tokens in use by its last load report (polled every ``--poll-s``), each pick
                adding the request's prompt tokens to that rank until the next report (its
                ``WorkerLoadManager.select_and_increment_lowest_dp_load``, read from the source)

Workload: Poisson arrivals; prompts 500-4,000 tokens; true output lengths long-tailed (lognormal,
median 400, capped at 4,096); the router sees only the budget (``max_new_tokens``: the length
rounded up to a power of two, as clients ask for more than they get). Step cost
(ASSUMPTION, a roofline shape, not a measured profile): ``base_ms + per_token_us`` x the busiest
rank's KV tokens. Figures: the mean imbalance of KV in use over the ranks ((max - min) / mean,
sampled each step from 20 % of the arrival span to the last arrival: the steady state), the busiest rank's KV over the mean, mean and P99 decode step (the TPOT
every request sees), and output tokens per second. Prints a table, writes
``results/proxy/dp_ranks_sim.json`` and a PNG beside it.

    python benchmark/proxy/dp_ranks_sim.py --seeds 1 2 3      # about 2 min
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omniinfer.bench.records import recorded_args, write_results
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.policy_api import PolicyContext, RouteRequest, create_policy
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.workers import Role, Worker, WorkerLoads

HERE = Path(__file__).resolve().parent
POLICIES = ("round_robin", "min_tokens", "oas_dp")


@dataclass
class Job:
    prompt: int
    length: int  # tokens it will generate
    budget: int  # what the router is told
    done: int = 0
    rank: int = -1
    worker: int = 0


def workload(count: int, rate_per_s: float, seed: int) -> list[tuple[float, Job]]:
    rng = random.Random(seed)
    out, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        length = max(8, min(4096, int(rng.lognormvariate(math.log(400), 0.9))))
        out.append((now, Job(rng.randint(500, 4000), length, 2 ** math.ceil(math.log2(length)))))
    return out


class Pool:
    """``workers`` x ``ranks`` decode ranks; what each holds; the step clock."""

    def __init__(self, workers: int, ranks: int) -> None:
        self.workers = [Worker(f"http://10.0.0.{i + 1}:30000", Role.DECODE)
                        for i in range(workers)]
        for w in self.workers:
            w.healthy = True
            w.set_dp_size(ranks)
        self.running: list[list[list[Job]]] = [[[] for _ in range(ranks)] for _ in self.workers]

    def kv(self) -> list[int]:
        return [sum(j.prompt + j.done for j in rank) for w in self.running for rank in w]

    def report(self) -> None:
        """Each worker's load report, as ``/v1/loads`` gives it (per rank)."""
        for w, ranks in zip(self.workers, self.running, strict=True):
            w.loads = WorkerLoads.from_json({"loads": [
                {"dp_rank": r, "num_used_tokens": sum(j.prompt + j.done for j in jobs),
                 "num_running_reqs": len(jobs)} for r, jobs in enumerate(ranks)]}, 0.0)


async def place(policy_name: str, pool: Pool, jobs: list[Job], state: dict[str, Any]) -> None:
    """Decide (worker, rank) for jobs arriving in one step."""
    if policy_name == "oas_dp":
        views = [RouteRequest(str(id(j)), j.prompt, j.budget) for j in jobs]
        decisions = await asyncio.gather(*(state["oas"].schedule(v, pool.workers) for v in views))
        for job, decision in zip(jobs, decisions, strict=True):
            job.worker = pool.workers.index(decision.worker)
            job.rank = decision.rank
            decision.worker.book_rank(job.rank, job.prompt + job.budget)
            decision.worker.inflight_requests += 1
            decision.worker.inflight_tokens += job.prompt + job.budget
        return
    slots = [(w, r) for w in range(len(pool.workers)) for r in range(pool.workers[w].dp_size)]
    for job in jobs:
        if policy_name == "round_robin":
            job.worker, job.rank = slots[state["next"] % len(slots)]
            state["next"] += 1
        else:  # the fewest tokens by the last report plus picks since; ties to the lowest rank
            cached = state["cached"]
            job.worker, job.rank = min(slots, key=lambda s: (cached.get(s, 0), s))
            cached[(job.worker, job.rank)] = cached.get((job.worker, job.rank), 0) + job.prompt


def release(policy_name: str, pool: Pool, job: Job) -> None:
    if policy_name == "oas_dp":
        w = pool.workers[job.worker]
        w.release_rank(job.rank, job.prompt + job.budget)
        w.inflight_requests -= 1
        w.inflight_tokens -= job.prompt + job.budget


async def simulate(policy_name: str, arrivals: list[tuple[float, Job]], args: argparse.Namespace
                   ) -> dict[str, float]:
    pool = Pool(args.workers, args.ranks)
    state: dict[str, Any] = {"next": 0, "cached": {}}
    if policy_name == "oas_dp":
        state["oas"] = create_policy("oas", PolicyContext(RouterConfig(dp_aware=True),
                                                          PrefixIndex(), Role.DECODE))
    pending = [(t, Job(j.prompt, j.length, j.budget)) for t, j in arrivals]
    window = (0.2 * pending[-1][0], pending[-1][0])  # steady state: past the ramp, before drain
    now, next_poll, index, finished, tokens = 0.0, 0.0, 0, 0, 0
    imbalance, peak, steps = [], [], []
    while finished < len(pending):
        arrived = []
        while index < len(pending) and pending[index][0] <= now:
            arrived.append(pending[index][1])
            index += 1
        if arrived:
            await place(policy_name, pool, arrived, state)
            for job in arrived:
                pool.running[job.worker][job.rank].append(job)
        if now >= next_poll:
            pool.report()
            state["cached"] = {(w, r): worker.loads.rank(r).used_tokens
                               for w, worker in enumerate(pool.workers)
                               for r in range(worker.dp_size)}
            next_poll = now + args.poll_s
        kv = pool.kv()
        mean = sum(kv) / len(kv)
        step_s = (args.base_ms + args.per_token_us * max(kv) / 1000) / 1000
        if mean > 0 and window[0] <= now <= window[1]:
            imbalance.append((max(kv) - min(kv)) / mean)
            peak.append(max(kv) / mean)
            steps.append(step_s)
        for ranks in pool.running:
            for jobs in ranks:
                for job in list(jobs):
                    job.done += 1
                    tokens += 1
                    if job.done >= job.length:
                        jobs.remove(job)
                        release(policy_name, pool, job)
                        finished += 1
        now += step_s
    steps_sorted = sorted(steps)
    return {"imbalance": statistics.fmean(imbalance), "busiest_over_mean": statistics.fmean(peak),
            "step_ms_mean": 1000 * statistics.fmean(steps),
            "step_ms_p99": 1000 * steps_sorted[int(0.99 * (len(steps_sorted) - 1))],
            "tokens_per_s": tokens / now}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = [r["policy"] for r in rows]
    axes[0].bar(names, [r["imbalance"] for r in rows], color="#4c72b0")
    axes[0].set_title("KV imbalance over ranks ((max-min)/mean)")
    axes[1].bar(names, [r["step_ms_mean"] for r in rows], color="#dd8452")
    axes[1].set_title("mean decode step, ms (lockstep ranks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=1, help="decode servers")
    p.add_argument("--ranks", type=int, default=64, help="DP ranks per server (paper: 64)")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rate", type=float, default=40.0, help="arrivals a second")
    p.add_argument("--poll-s", type=float, default=1.0, help="load reports, as both routers poll")
    p.add_argument("--base-ms", type=float, default=20.0, help="ASSUMPTION: a step's fixed cost")
    p.add_argument("--per-token-us", type=float, default=0.1,
                   help="ASSUMPTION: step cost per KV token of the busiest rank")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=HERE.parent / "results" / "proxy" / "dp_ranks_sim.json")
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    for seed in tqdm(args.seeds, desc="seeds"):
        arrivals = workload(args.requests, args.rate, seed)
        for name in POLICIES:
            runs[name].append(asyncio.run(simulate(name, arrivals, args)))
    rows = [{"policy": name, **{k: statistics.median(r[k] for r in runs[name])
                                 for k in runs[name][0]}} for name in POLICIES]
    print(f"{args.workers} x {args.ranks} ranks, {args.requests} requests at {args.rate}/s, "
          f"seeds {args.seeds} (medians)")
    print(f"{'policy':<14}{'imbalance':>10}{'busiest/mean':>14}{'step ms':>9}{'P99 step':>10}"
          f"{'tokens/s':>10}")
    for r in rows:
        print(f"{r['policy']:<14}{r['imbalance']:>10.3f}{r['busiest_over_mean']:>14.3f}"
              f"{r['step_ms_mean']:>9.2f}{r['step_ms_p99']:>10.2f}{r['tokens_per_s']:>10.0f}")
    write_results(args.out, {"args": recorded_args(args, HERE.parents[1]),
                             "rows": rows, "runs": runs})
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    sys.exit(main())
