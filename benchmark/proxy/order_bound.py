"""How much SLO capacity the order of a central queue can buy on a workload, in the best case.

A router that holds requests (OAS) can choose which request a free prefill instance gets next;
one that dispatches at arrival (smg's policies) leaves each instance first come, first served.
This script bounds what that choice is worth, before any router detail: ``servers`` identical
prefill instances fed from one central queue that knows every request's prefill time exactly
(no prediction error, no transfer, no batching, no prefix cache: ASSUMPTION, an idealised
model), the requests
of the same workloads and arrival processes ``capacity.py`` uses (Poisson for the paper mix,
the Azure and Mooncake conversation traces' own arrival times compressed to a rate). TTFT is
queueing + prefill time; a request is within the SLO when its TTFT is under ``--slo``. For each
order the 90 % SLO capacity is found by climbing the rate (multiples of the fleet's throughput,
``servers`` / mean prefill time, in ``--step``) until two rates in a row fall under 90 %, so no
capacity is cut off by the end of a grid, and divided by first come, first served's on the same
requests:
the most any order can add when placement is perfect.

Orders: ``fcfs`` (one central FIFO queue: work-conserving, so at least as good as any
dispatch-at-arrival policy with FIFO instances); ``shortest`` (least prefill time first,
non-preemptive); ``fcfs_late_last`` and ``shortest_late_last`` (requests that can no longer meet
the SLO — waited + prefill time > SLO — go after all the others, oldest first). Beside them,
``round_robin`` dispatches at arrival to the instances in turn, each first come, first served
(smg's ``round_robin``, idealised the same way).

The tail: at each peer's 90 % capacity rate (``fcfs`` and ``round_robin``), every order's P99
TTFT over the peer's own (``name@peer``), with ``largest_last`` added: first come, first served
with the 1 % longest prefills given up (after every other request), the order that spends the
1 % a P99 may lose where it saves the most work. Pure Python; seconds to run:

    python benchmark/proxy/order_bound.py          # writes results/proxy/order_bound.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from capacity import at_rate, base_requests
from capacity_math import capacity_at

from omniinfer.emulator.profile import load_profile

HERE = Path(__file__).resolve().parent

MAX_MULTIPLIER = 10.0  # a sweep that finds no knee below this many times the throughput fails

# (arrival, prefill seconds) of the queued requests, now, SLO -> the index to serve next
Pick = Callable[[Sequence[tuple[float, float]], float, float], int]


def _fcfs(queue: Sequence[tuple[float, float]], now: float, slo: float) -> int:
    return min(range(len(queue)), key=lambda i: queue[i][0])


def _shortest(queue: Sequence[tuple[float, float]], now: float, slo: float) -> int:
    return min(range(len(queue)), key=lambda i: (queue[i][1], queue[i][0]))


def _late_last(first: Pick) -> Pick:
    def pick(queue: Sequence[tuple[float, float]], now: float, slo: float) -> int:
        alive = [i for i, (arrival, work) in enumerate(queue) if now - arrival + work <= slo]
        if not alive:
            return _fcfs(queue, now, slo)
        return alive[first([queue[i] for i in alive], now, slo)]
    return pick


def _largest_last(limit: float) -> Pick:
    """First come, first served among the requests whose prefill time is at most ``limit``;
    the longer ones after them (oldest first). With ``limit`` the 99th percentile of the
    requests' prefill times this gives up at most 1 % of them, the ones that take the most
    work, to keep every other request's TTFT short: a candidate for the least P99 TTFT."""

    def pick(queue: Sequence[tuple[float, float]], now: float, slo: float) -> int:
        small = [i for i, (_, work) in enumerate(queue) if work <= limit]
        if not small:
            return _fcfs(queue, now, slo)
        return min(small, key=lambda i: queue[i][0])

    return pick


ORDERS: dict[str, Pick] = {"fcfs": _fcfs, "shortest": _shortest,
                           "fcfs_late_last": _late_last(_fcfs),
                           "shortest_late_last": _late_last(_shortest)}
TAIL_SHARE = 0.99  # the tail question: each order's P99 TTFT at a peer's 90 % capacity


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(TAIL_SHARE * len(ordered)))]


def ttfts(arrivals: Sequence[float], works: Sequence[float], servers: int, pick: Pick,
          slo: float) -> list[float]:
    """TTFT of each request under ``pick`` on ``servers`` instances fed from one queue."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
    free = [0.0] * servers  # when each instance is next free (a heap)
    queue: list[int] = []
    out = [0.0] * len(arrivals)
    nxt = 0
    while nxt < len(pending) or queue:
        now = heapq.heappop(free)
        if not queue and arrivals[pending[nxt]] > now:
            now = arrivals[pending[nxt]]
        while nxt < len(pending) and arrivals[pending[nxt]] <= now:
            queue.append(pending[nxt])
            nxt += 1
        chosen = queue.pop(pick([(arrivals[i], works[i]) for i in queue], now, slo))
        out[chosen] = now + works[chosen] - arrivals[chosen]
        heapq.heappush(free, now + works[chosen])
    return out


def dispatched_ttfts(arrivals: Sequence[float], works: Sequence[float], servers: int
                     ) -> list[float]:
    """TTFT of each request sent at arrival to the next instance in turn (round robin), each
    instance first come, first served: smg's ``round_robin`` without batching or transfer."""
    free = [0.0] * servers
    out = [0.0] * len(arrivals)
    for turn, i in enumerate(sorted(range(len(arrivals)), key=lambda k: arrivals[k])):
        server = turn % servers
        start = max(free[server], arrivals[i])
        free[server] = start + works[i]
        out[i] = free[server] - arrivals[i]
    return out


def prefill_work(profile: str, prompts: Sequence[int]) -> list[float]:
    """Prefill seconds of each prompt on one instance of ``profile`` (no cache; the per-pass
    base left out as ``capacity.py``'s estimate leaves it: batching shares it)."""
    cost = load_profile(profile).cost
    return [cost.prefill_per_request_s + cost.prefill_per_token_s * n
            + cost.prefill_attention_s * n * n / 2 for n in prompts]


def capacities(workload: str, repeat: int, args: argparse.Namespace
               ) -> tuple[dict[str, float], dict[str, float]]:
    """Each order's 90 % SLO capacity (requests per model minute) on one repeat's requests,
    and each order's P99 TTFT (seconds) at each peer's (``fcfs``, ``round_robin``) capacity
    rate, keyed ``order@peer``, where ``largest_last`` (the 1 % longest prefills given up)
    joins the orders."""
    offset = args.trace_offset + repeat * args.requests
    requests = base_requests(workload, args.requests, args.seed + repeat, offset, 0.05)
    works = prefill_work(args.profile, [r.prompt_tokens for r in requests])
    throughput = 60.0 * args.servers / statistics.fmean(works)  # QPM with every instance busy
    found: dict[str, float] = {}
    runs: dict[str, Callable[[list[float]], list[float]]] = {
        name: (lambda arrivals, pick=pick: ttfts(arrivals, works, args.servers, pick, args.slo))
        for name, pick in ORDERS.items()}
    runs["round_robin"] = lambda arrivals: dispatched_ttfts(arrivals, works, args.servers)
    for name, run in runs.items():
        points: list[tuple[float, float]] = []
        multiplier, below = args.first_multiplier, 0
        while below < 2:  # climb until two points in a row fall under 90 %: the knee is passed
            if multiplier > MAX_MULTIPLIER:
                raise RuntimeError(f"{workload} repeat {repeat} {name}: no knee below "
                                   f"{MAX_MULTIPLIER}x the throughput")
            qpm = throughput * multiplier
            timed = at_rate(requests, workload, qpm, args.seed + repeat)
            got = run([r.arrival_s for r in timed])
            share = sum(t <= args.slo for t in got) / len(got)
            points.append((qpm, share))
            below = below + 1 if share < 0.90 else 0
            multiplier += args.step
        capacity, bound = capacity_at(points, 0.90)
        if bound:  # under 90 % at the first rate: no capacity to compare
            raise RuntimeError(f"{workload} repeat {repeat} {name}: under 90 % at "
                               f"{args.first_multiplier}x; lower --first-multiplier")
        found[name] = capacity
    limit = sorted(works)[int(TAIL_SHARE * (len(works) - 1))]
    runs["largest_last"] = lambda arrivals: ttfts(arrivals, works, args.servers,
                                                  _largest_last(limit), args.slo)
    tails: dict[str, float] = {}
    for peer in ("fcfs", "round_robin"):
        arrivals = [r.arrival_s for r in at_rate(requests, workload, found[peer],
                                                 args.seed + repeat)]
        tails.update({f"{name}@{peer}": p99(run(arrivals)) for name, run in runs.items()})
    return found, tails


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="paper,azure,mooncake")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slo", type=float, default=2.0, help="TTFT objective, model seconds")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-offset", type=int, default=0)
    p.add_argument("--first-multiplier", type=float, default=0.5,
                   help="first rate, as a multiple of the fleet's throughput")
    p.add_argument("--step", type=float, default=0.05, help="rate step, same unit")
    p.add_argument("--out", type=Path, default=HERE.parent / "results" / "proxy" / "order_bound.json")
    args = p.parse_args()
    result: dict[str, object] = {"args": {k: str(v) for k, v in vars(args).items() if k != "out"}}
    for workload in args.workloads.split(","):
        both = [capacities(workload, k, args) for k in range(args.repeats)]
        runs, tails = [run for run, _ in both], [tail for _, tail in both]
        ratios = {name: [run[name] / run["fcfs"] for run in runs] for name in runs[0]}
        peer_of = {name: name.rpartition("@")[2] for name in tails[0]}
        tail_ratios = {name: [tail[name] / tail[f"{peer}@{peer}"] for tail in tails]
                       for name, peer in peer_of.items()}
        result[workload] = {"capacity_qpm": runs, "over_fcfs": ratios, "p99_ttft_s": tails,
                            "p99_over_peer": tail_ratios}
        for title, table in (("90 % SLO capacity over central FCFS", ratios),
                             ("P99 TTFT at a peer's 90 % capacity (name@peer), over the peer's",
                              tail_ratios)):
            print(f"{workload}: {title}, per repeat")
            for name, values in table.items():
                print(f"  {name:20s} " + "  ".join(f"{v:.3f}" for v in values)
                      + f"   median {statistics.median(values):.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
