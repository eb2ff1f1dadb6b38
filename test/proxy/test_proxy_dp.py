"""``--dp-aware``: rank counts read from hostile answers, per-rank loads, the least-loaded rank,
the body fields each worker gets, OAS's decode LPT over ranks, and the whole path over HTTP."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.load_feed_wire import LoadStat
from omniinfer.proxy.attempt import Booking
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.core import Router
from omniinfer.proxy.dp import (
    assign_ranks,
    dp_size_from,
    learn_dp_size,
    least_loaded_rank,
    rank_fields,
)
from omniinfer.proxy.load_subscriber import RankFeed, merged_loads
from omniinfer.proxy.policy_api import Decision, PolicyContext, RouteRequest, create_policy
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.request import Request
from omniinfer.proxy.workers import MAX_DP_RANKS, Role, Worker, WorkerLoads


def _worker(role: Role, ranks: int, port: int = 1) -> Worker:
    worker = Worker(f"http://127.0.0.1:{port}", role)
    worker.healthy = True
    worker.set_dp_size(ranks)
    return worker


@pytest.mark.parametrize("info", [
    None, [], {}, {"dp_size": None}, {"dp_size": "2"}, {"dp_size": True}, {"dp_size": 0},
    {"dp_size": -3}, {"dp_size": 2.0}, {"dp_size": MAX_DP_RANKS + 1}, {"dp_size": 10**30}])
def test_a_rank_count_is_a_small_positive_int_or_refused(info: Any) -> None:
    with pytest.raises(ValueError):
        dp_size_from(info)
    new = _worker(Role.DECODE, 1)
    learn_dp_size(new, info)  # the router keeps going: one rank, no rank named
    assert new.dp_size == 1 and new.rank_inflight_tokens == [0]
    known = _worker(Role.DECODE, 4)  # re-admitted, its answer timed out under load: kept
    learn_dp_size(known, info)
    assert known.dp_size == 4 and len(known.rank_inflight_tokens) == 4
    learn_dp_size(known, {"dp_size": 2})  # restarted with fewer ranks: a real answer counts
    assert known.dp_size == 2 and len(known.rank_requests) == 2
    assert dp_size_from({"dp_size": 8, "other": "x"}) == 8


def test_polled_loads_keep_each_ranks_part_by_its_dp_rank() -> None:
    entries = [{"dp_rank": 1, "num_used_tokens": 700, "num_waiting_uncached_tokens": 5},
               {"dp_rank": 0, "num_used_tokens": 100},
               {"dp_rank": 1, "num_used_tokens": 9},  # repeated rank: the first counts
               {"dp_rank": -1, "num_used_tokens": 9}, {"dp_rank": "x", "num_used_tokens": 3},
               {"dp_rank": 10**9, "num_used_tokens": 9}]
    loads = WorkerLoads.from_json({"loads": entries}, 0.0)
    assert loads.rank(1).used_tokens == 700 and loads.rank(1).waiting_uncached_tokens == 5
    assert loads.rank(0).used_tokens == 100
    assert loads.rank(4).used_tokens == 3  # no usable dp_rank: its position
    assert loads.rank(7).used_tokens == 0 and sorted(loads.ranks) == [0, 1, 4]
    assert loads.used_tokens == 700 + 100 + 9 + 9 + 3 + 9  # the sum is as before


def test_the_load_feed_keeps_each_ranks_part_by_its_socket() -> None:
    feeds = [RankFeed(f"tcp://127.0.0.1:{5000 + r}") for r in range(3)]
    feeds[0].last = LoadStat(1, 0, 50, 1000)
    feeds[2].last = LoadStat(2, 1, 900, 1000, attn_dp_rank=0, num_waiting_uncached_tokens=40)
    loads = merged_loads(feeds, WorkerLoads())
    assert loads.rank(0).used_tokens == 50 and loads.rank(2).used_tokens == 900
    assert loads.rank(2).waiting_uncached_tokens == 40 and 1 not in loads.ranks


def test_least_loaded_rank_takes_the_larger_of_own_bookings_and_the_ranks_report() -> None:
    decode = _worker(Role.DECODE, 4)
    decode.loads = WorkerLoads.from_json({"loads": [
        {"dp_rank": r, "num_used_tokens": used} for r, used in enumerate([500, 0, 300, 0])]}, 0)
    decode.rank_inflight_tokens = [0, 400, 0, 350]
    assert least_loaded_rank(decode) == 2  # 500, 400, 300, 350
    prefill = _worker(Role.PREFILL, 2)  # prefill: queued uncached tokens, not KV held
    prefill.loads = WorkerLoads.from_json({"loads": [
        {"dp_rank": 0, "num_used_tokens": 5000, "num_waiting_uncached_tokens": 10},
        {"dp_rank": 1, "num_used_tokens": 0, "num_waiting_uncached_tokens": 900}]}, 0)
    assert least_loaded_rank(prefill) == 0
    idle = _worker(Role.REGULAR, 3)
    picks = []
    for _ in range(6):  # equal loads: fewest requests sent, so every rank in turn
        rank = least_loaded_rank(idle)
        idle.book_rank(rank, 0)
        picks.append(rank)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_each_worker_gets_its_own_rank_and_the_decode_learns_the_prefills() -> None:
    p2, d4 = _worker(Role.PREFILL, 2), _worker(Role.DECODE, 4, 2)
    p1, d1 = _worker(Role.PREFILL, 1, 3), _worker(Role.DECODE, 1, 4)
    both = [Decision(p2, "x"), Decision(d4, "x", rank=3)]
    assign_ranks(both)
    assert both[0].rank == 0 and both[1].rank == 3  # a policy's rank is kept
    assert rank_fields(both) == [{"routed_dp_rank": 0, "disagg_prefill_dp_rank": 0},
                                 {"routed_dp_rank": 3, "disagg_prefill_dp_rank": 0}]
    only_decode = [Decision(p1, "x"), Decision(d4, "x")]
    assign_ranks(only_decode)
    assert rank_fields(only_decode) == [{}, {"routed_dp_rank": 0}]
    only_prefill = [Decision(p2, "x", rank=1), Decision(d1, "x")]
    assert rank_fields(only_prefill) == [{"routed_dp_rank": 1, "disagg_prefill_dp_rank": 1},
                                         {"disagg_prefill_dp_rank": 1}]
    regular = [Decision(_worker(Role.REGULAR, 2), "x", rank=1)]
    assert rank_fields(regular) == [{"routed_dp_rank": 1}]


def test_bodies_differ_only_by_the_rank_fields_and_a_one_rank_body_is_unchanged() -> None:
    req = Request("1", "generate")
    req.prepare({"text": "hi", "rid": "client"}, 1, RouteRequest("1", 2, 4))
    plain, ranked = req.payloads(["r1"], {"bootstrap_room": 7}, [{}, {"routed_dp_rank": 2}])
    assert json.loads(plain) == {"text": "hi", "rid": "r1", "bootstrap_room": 7}
    assert json.loads(ranked) == {**json.loads(plain), "routed_dp_rank": 2}
    assert req.worker_rids == []  # the bodies change nothing; the attempt records its rids
    req.attempted(["r1"], {"bootstrap_room": 7})
    assert req.worker_rids == ["r1"] and req.bootstrap_room == 7  # one attempt, one rid


def test_a_booking_holds_its_rank_and_gives_it_back_once_even_after_the_ranks_went() -> None:
    router = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"], dp_aware=True))
    worker = router.pool.all()[0]
    worker.set_dp_size(4)
    view = RouteRequest("r", 100, 20)
    booking = Booking(router, view, worker, 120, rank=3)
    assert worker.rank_inflight_tokens == [0, 0, 0, 120] and worker.rank_requests[3] == 1
    booking.release(True)
    booking.release(True)
    assert worker.rank_inflight_tokens == [0, 0, 0, 0] and worker.inflight_tokens == 0
    late = Booking(router, view, worker, 50, rank=3)
    worker.set_dp_size(2)  # restarted with fewer ranks while the request ran
    late.release(False)
    assert worker.rank_inflight_tokens == [0, 0] and worker.inflight_tokens == 0


def _decode_spread(ranks_per_worker: int, workers: int, seed: int) -> tuple[list[int], int]:
    """OAS decode over ``workers`` decode workers of ``ranks_per_worker`` ranks: 16 requests
    per rank arrive together; returns the tokens each rank was given and the largest request."""
    policy = create_policy("oas", PolicyContext(RouterConfig(), PrefixIndex(), Role.DECODE))
    pool = [_worker(Role.DECODE, ranks_per_worker, port=10 + i) for i in range(workers)]
    rng = random.Random(seed)
    views = [RouteRequest(f"r{i}", rng.randint(50, 3000), rng.choice([16, 64, 512, 1024]))
             for i in range(16 * ranks_per_worker * workers)]

    async def run() -> list[Decision]:
        pending = [policy.schedule(v, pool) for v in views]
        return list(await asyncio.gather(*pending))

    decisions = run_async(run())
    for decision, view in zip(decisions, views, strict=True):
        assert decision.rank is not None
        decision.worker.book_rank(decision.rank, view.prompt_tokens + view.output_tokens)
    loads = [t for w in pool for t in w.rank_inflight_tokens]
    return loads, max(v.prompt_tokens + v.output_tokens for v in views)


@pytest.mark.parametrize("ranks,workers,seed", [(2, 1, 0), (8, 2, 1), (32, 2, 2), (64, 1, 3)])
def test_oas_decode_lpt_places_over_every_rank_within_one_request_of_even(
        ranks: int, workers: int, seed: int) -> None:
    loads, largest = _decode_spread(ranks, workers, seed)
    assert len(loads) == ranks * workers and min(loads) > 0
    assert max(loads) - min(loads) <= largest  # LPT's bound: one job of the mean


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


def test_dp_aware_over_http_sends_each_worker_its_rank_and_a_one_rank_worker_none() -> None:
    """PD through the real router over HTTP: a 2-rank prefill, a 4-rank decode and a decode
    whose /server_info names no usable dp_size."""
    def info(size: Any) -> Any:
        async def route(request: web.Request) -> web.Response:
            return web.json_response({"dp_size": size})
        return route

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"text": "ok", "meta_info": {"completion_tokens": 1}})

    async def main() -> None:
        prefill = ScriptedWorker({"/server_info": info(2), "/generate": answer})
        decode = ScriptedWorker({"/server_info": info(4), "/generate": answer})
        odd = ScriptedWorker({"/server_info": info("many"), "/generate": answer})
        p_url, d_url, o_url = [await w.start() for w in (prefill, decode, odd)]
        try:
            async with router_for([], pd_disaggregation=True, worker_urls=[], dp_aware=True,
                                  prefill_urls=[(p_url, None)], decode_urls=[d_url, o_url],
                                  prefill_policy="round_robin", decode_policy="round_robin"
                                  ) as (base, serving):
                router = serving.router
                assert [w.dp_size for w in router.pool.all()] == [2, 4, 1]
                async with aiohttp.ClientSession() as s:
                    for i in range(8):
                        body = {"text": f"p{i}", "sampling_params": {"max_new_tokens": 2}}
                        async with s.post(base + "/generate", json=body) as r:
                            assert r.status == 200, await r.text()
        finally:
            for w in (prefill, decode, odd):
                await w.close()
        sent = {name: [json.loads(b) for _, path, _, b in w.seen if path == "/generate"]
                for name, w in (("p", prefill), ("d", decode), ("o", odd))}
        assert len(sent["p"]) == 8 and len(sent["d"]) == 4 and len(sent["o"]) == 4
        assert sorted(b["routed_dp_rank"] for b in sent["p"]) == [0] * 4 + [1] * 4
        for b in sent["p"]:
            assert b["disagg_prefill_dp_rank"] == b["routed_dp_rank"]
        assert sorted(b["routed_dp_rank"] for b in sent["d"]) == [0, 1, 2, 3]
        by_room = {b["bootstrap_room"]: b["routed_dp_rank"] for b in sent["p"]}
        for b in sent["d"] + sent["o"]:
            assert b["disagg_prefill_dp_rank"] == by_room[b["bootstrap_room"]]
        assert all("routed_dp_rank" not in b for b in sent["o"])
        assert all(sum(w.rank_inflight_tokens) == 0 for w in router.pool.all())

    run_async(main())
