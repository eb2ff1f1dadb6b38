"""Engine logic without HTTP: batching, chunked prefill, prefix cache, admission, PD, transfer."""

from __future__ import annotations

import asyncio
import time

import pytest
from emu_helpers import ids, small_profile

from omniinfer.emulator.engine import EmulatedEngine, EmuRequest
from omniinfer.emulator.interfaces import PrefillItem
from omniinfer.emulator.profile import (
    Profile,
    ProfileError,
    load_profile,
    profile_from_dict,
    shipped_profiles,
)
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.emulator.tokenizer import EmulatedTokenizer


def make_profile(**capacity: object) -> Profile:
    return small_profile("test", {"chunked_prefill_size": 4096, **capacity},
                         transfer={"kv_bytes_per_token": 1e6, "bandwidth_gb_s": 1.0, "latency_s": 0.01})


async def run_all(engine: EmulatedEngine, requests: list[EmuRequest]) -> None:
    engine.start()
    try:
        for r in requests:
            while not r.finished:
                await r.wait_progress()
    finally:
        await engine.stop()


def test_continuous_batching_one_prefill_then_shared_decode_steps() -> None:
    async def main() -> EmulatedEngine:
        engine = EmulatedEngine(make_profile(), time_scale=0)
        reqs = [engine.submit(EmuRequest(ids(100, 1000 * i), 8)) for i in range(1, 4)]
        await run_all(engine, reqs)
        assert all(len(r.output_ids) == 8 for r in reqs)
        assert all(r.finish_reason == {"type": "length", "length": 8} for r in reqs)
        return engine

    engine = asyncio.run(main())
    assert engine.stats.prefill_passes == 1  # all three fit one token budget
    assert engine.stats.decode_steps == 7  # first token from prefill, 7 shared steps
    expected = engine.cost.prefill_time([PrefillItem(100, 0)] * 3) + sum(
        engine.cost.decode_time(3, 3 * (100 + k)) for k in range(1, 8)
    )
    assert engine.model_time == pytest.approx(expected)


def test_late_arrival_joins_running_batch() -> None:
    async def main() -> tuple[EmuRequest, EmuRequest, EmulatedEngine]:
        engine = EmulatedEngine(make_profile(), time_scale=0.001)
        a = engine.submit(EmuRequest(ids(50), 40))
        engine.start()
        while len(a.output_ids) < 10:
            await a.wait_progress()
        b = engine.submit(EmuRequest(ids(50, 5000), 5))
        for r in (a, b):
            while not r.finished:
                await r.wait_progress()
        await engine.stop()
        return a, b, engine

    a, b, engine = asyncio.run(main())
    assert b.model_finished < a.model_finished  # b ran inside a's decode batch and left first
    assert engine.stats.prefill_passes == 2


def test_chunked_prefill_splits_long_prompt_by_token_budget() -> None:
    async def main() -> EmulatedEngine:
        engine = EmulatedEngine(make_profile(chunked_prefill_size=256), time_scale=0)
        r = engine.submit(EmuRequest(ids(1000), 1))
        await run_all(engine, [r])
        return engine

    engine = asyncio.run(main())
    assert engine.stats.prefill_passes == 4  # 256 + 256 + 256 + 232
    chunks = [PrefillItem(256, 0), PrefillItem(256, 256), PrefillItem(256, 512), PrefillItem(232, 768)]
    assert engine.model_time == pytest.approx(sum(engine.cost.prefill_time([c]) for c in chunks))


def test_prefix_cache_hit_on_shared_prefix() -> None:
    async def main() -> tuple[EmuRequest, EmuRequest]:
        engine = EmulatedEngine(make_profile(), time_scale=0)
        first = engine.submit(EmuRequest(ids(500) + ids(50, 90000), 2))
        await run_all(engine, [first])
        second = engine.submit(EmuRequest(ids(500) + ids(50, 70000), 2))
        await run_all(engine, [second])
        return first, second

    first, second = asyncio.run(main())
    assert first.cached_tokens == 0
    assert second.cached_tokens == 500


def test_radix_cache_lru_eviction_and_locks() -> None:
    cache = RadixCache(capacity=100)
    cache.insert(ids(60, 0))
    cache.insert(ids(30, 1000))
    assert cache.match_prefix(ids(60, 0)).length == 60  # touch A: B is now least recent
    cache.insert(ids(40, 2000))  # 130 > 100: evict B (30) -> 100
    assert cache.match_prefix(ids(30, 1000)).length == 0
    assert cache.match_prefix(ids(60, 0)).length == 60
    assert cache.size().total == 100
    locked = cache.match_prefix(ids(40, 2000)).node
    cache.lock(locked)
    assert cache.size().evictable == 60
    assert cache.evict(1000) == 60  # only the unlocked A goes
    assert cache.match_prefix(ids(40, 2000)).length == 40
    cache.unlock(locked)
    assert cache.size() == (40, 40)


def test_radix_cache_splits_on_partial_match() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 9]).length == 3
    assert cache.insert([1, 2, 3, 9, 9]) == 2
    assert cache.size().total == 7
    assert cache.match_prefix([1, 2, 3, 4, 5]).length == 5


def test_kv_capacity_admission_holds_requests_back() -> None:
    # pool 1000: each request needs 400 prompt + 0.5 * 100 reserved output = 450; two fit.
    async def main() -> list[EmuRequest]:
        engine = EmulatedEngine(make_profile(max_total_tokens=1000, new_token_ratio=0.5), time_scale=0)
        engine.kv.tree = None  # no caching: admission alone decides
        reqs = [engine.submit(EmuRequest(ids(400, 10_000 * (i + 1)), 100)) for i in range(3)]
        await run_all(engine, reqs)
        assert engine.kv.used() == 0
        return reqs

    a, b, c = asyncio.run(main())
    assert a.model_first_token == b.model_first_token
    assert c.model_first_token > min(a.model_finished, b.model_finished)


def test_pool_full_retracts_and_resumes() -> None:
    # ratio 0 reserves nothing, so both are admitted and the pool runs out during decode.
    async def main() -> list[EmuRequest]:
        engine = EmulatedEngine(make_profile(max_total_tokens=300, new_token_ratio=0.0), time_scale=0)
        reqs = [engine.submit(EmuRequest(ids(100, 10_000 * (i + 1)), 120)) for i in range(2)]
        await run_all(engine, reqs)
        return reqs

    reqs = asyncio.run(main())
    assert all(len(r.output_ids) == 120 for r in reqs)
    assert sum(r.num_retractions for r in reqs) >= 1


def test_decode_step_time_grows_with_batch_and_kv() -> None:
    cost = make_profile().cost_model()
    assert cost.decode_time(8, 8000) > cost.decode_time(1, 8000) > cost.decode_time(1, 100)
    assert cost.decode_time(4, 1000) == pytest.approx(0.02 + 4 * 0.001 + 1000 * 1e-6)


def test_prefill_pass_slows_with_running_requests_when_the_profile_says_so() -> None:
    plain = make_profile()
    contended = plain.with_cost(prefill_per_running_request_s=0.05)
    items = [PrefillItem(200, 0)]
    assert plain.cost_model().prefill_time(items, running=4) == plain.cost_model().prefill_time(items)
    assert contended.cost_model().prefill_time(items, running=4) == pytest.approx(
        plain.cost_model().prefill_time(items) + 4 * 0.05)

    async def main() -> float:  # the engine passes its running batch to the cost model
        engine = EmulatedEngine(contended, time_scale=0)
        engine.start()
        first = engine.submit(EmuRequest(ids(100), 50))
        while not first.output_ids:
            await first.wait_progress()
        second = engine.submit(EmuRequest(ids(100, 50_000), 1))
        await run_all(engine, [first, second])
        return engine.stats.prefill_busy_s

    cost = contended.cost_model()
    alone, beside_one = cost.prefill_time([PrefillItem(100, 0)]), cost.prefill_time([PrefillItem(100, 0)], 1)
    assert asyncio.run(main()) == pytest.approx(alone + beside_one)


def test_abort_frees_memory_and_finishes() -> None:
    async def main() -> tuple[EmuRequest, EmulatedEngine]:
        engine = EmulatedEngine(make_profile(), time_scale=0.001)
        r = engine.submit(EmuRequest(ids(100), 10_000))
        engine.start()
        while len(r.output_ids) < 3:
            await r.wait_progress()
        assert engine.abort(r.rid) == 1
        await engine.stop()
        return r, engine

    r, engine = asyncio.run(main())
    assert r.finish_reason is not None and r.finish_reason["type"] == "abort"
    assert engine.kv.private_tokens == 0 and not engine.running
    tree = engine.kv.tree
    assert tree is not None and tree.size().evictable == tree.size().total


def test_pd_pairing_by_room_and_transfer_delay() -> None:
    transfer = make_profile().cost_model().transfer_time(200)
    assert transfer == pytest.approx(0.01 + 200 * 1e6 / 1e9)  # 0.21 s

    async def main() -> tuple[EmuRequest, EmuRequest, float, EmulatedEngine]:
        prefill = EmulatedEngine(make_profile(), mode="prefill", time_scale=1.0)
        decode = EmulatedEngine(make_profile(), mode="decode", time_scale=1.0)
        prefill.start()
        decode.start()
        waiter = asyncio.ensure_future(prefill.wait_room(42, timeout=5))  # decode polls first
        p = prefill.submit(EmuRequest(ids(200), 6, bootstrap_room=42))
        paired = await waiter
        assert paired is p and p.finished and len(p.output_ids) == 1
        assert 42 in prefill.held  # KV stays until pulled
        prefill.kv_fetched(42, transfer)
        d = EmuRequest(ids(200), 6, bootstrap_room=42)
        d.first_token, d.transfer_s = paired.output_ids[0], transfer
        t0 = time.monotonic()
        decode.submit_transferred(d)
        while not d.output_ids:
            await d.wait_progress()
        waited = time.monotonic() - t0
        while not d.finished:
            await d.wait_progress()
        deadline = time.monotonic() + 5 + transfer
        while prefill.held and time.monotonic() < deadline:  # released transfer_s after the pull
            await asyncio.sleep(0.01)
        await prefill.stop()
        await decode.stop()
        return p, d, waited, prefill

    p, d, waited, prefill = asyncio.run(main())
    assert d.output_ids[0] == p.output_ids[0]  # the prefill's token is the decode's first
    assert len(d.output_ids) == 6
    assert waited >= transfer * 0.95
    assert not prefill.held and prefill.kv.private_tokens == 0  # released after the transfer


def test_wait_room_times_out() -> None:
    async def main() -> object:
        engine = EmulatedEngine(make_profile(), mode="prefill", time_scale=0)
        return await engine.wait_room(7, timeout=0.05)

    assert asyncio.run(main()) is None


def test_submit_rejects_bad_requests() -> None:
    async def main() -> None:
        engine = EmulatedEngine(make_profile(max_total_tokens=100), time_scale=0)
        with pytest.raises(ValueError, match="empty"):
            engine.submit(EmuRequest([], 4))
        with pytest.raises(ValueError, match="pool"):
            engine.submit(EmuRequest(ids(90), 50))

    asyncio.run(main())


def test_tokenizer_is_deterministic_and_prefix_stable() -> None:
    tok = EmulatedTokenizer()
    a = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert a == EmulatedTokenizer().encode("The quick brown fox jumps over the lazy dog.")
    assert tok.encode("The quick brown fox jumps over the lazy dog. And more text")[: len(a)] == a
    assert "emulated" in tok.name


def test_shipped_profiles_load_and_bad_profiles_are_named() -> None:
    names = shipped_profiles()
    assert {"cpu-smollm2", "h100-llama3-8b", "ascend-r1-prefill", "ascend-r1-decode"} <= set(names)
    for name in names:
        assert load_profile(name).cost_model().decode_time(1, 100) > 0
    with pytest.raises(ProfileError, match="cost.decode_base_s"):
        profile_from_dict({"model": {"model_path": "m"}, "cost": {"decode_base_s": "fast"}}, "x.yaml")
    with pytest.raises(ProfileError, match="unknown field"):
        profile_from_dict({"model": {"model_path": "m"}, "cost": {"speed": 1}}, "x.yaml")
    with pytest.raises(ProfileError, match="no profile named"):
        load_profile("no-such-profile")


def test_abort_follows_sglangs_prefix_rule() -> None:
    """A known rid aborts every request whose rid starts with it; an unknown one aborts none."""
    async def main() -> dict[str, EmuRequest]:
        engine = EmulatedEngine(make_profile(), time_scale=0)
        reqs = {rid: engine.submit(EmuRequest(ids(10, 100 * i), 5, rid=rid))
                for i, rid in enumerate(("a", "ab", "b", "xy"), start=1)}
        assert engine.abort("x") == 0  # not a request here, although "xy" starts with it
        assert engine.abort("") == 0
        assert engine.abort("a") == 2
        return reqs

    reqs = asyncio.run(main())
    assert [r.finish_reason["type"] if r.finish_reason else None for r in reqs.values()] == [
        "abort", "abort", None, None]


def test_hang_fault_parks_or_stalls_until_aborted() -> None:
    async def main() -> tuple[EmuRequest, EmuRequest, EmulatedEngine, list[int]]:
        engine = EmulatedEngine(make_profile(), time_scale=0)
        parked = engine.submit(EmuRequest(ids(50), 10, stall_after_tokens=0))
        stalled = engine.submit(EmuRequest(ids(50, 5000), 10, stall_after_tokens=3))
        free = engine.submit(EmuRequest(ids(50, 9000), 10))
        engine.start()
        while not free.finished:
            await free.wait_progress()
        seen = [len(parked.output_ids), len(stalled.output_ids), engine.num_running(),
                engine.num_waiting(), engine.kv.private_tokens]
        engine.abort(parked.rid)
        engine.abort(stalled.rid)
        await engine.stop()
        return parked, stalled, engine, seen

    parked, stalled, engine, seen = asyncio.run(main())
    assert seen[:4] == [0, 3, 1, 1]  # the stalled one still runs, the parked one still waits
    assert seen[4] == 2  # the stalled one keeps its KV: a slot per decoded token (2 and 3)
    assert parked.finish_reason["type"] == stalled.finish_reason["type"] == "abort"
    assert engine.kv.private_tokens == 0 and not engine.stalled and not engine.parked


def test_a_decode_request_waiting_for_its_prefill_can_be_aborted() -> None:
    async def main() -> tuple[EmuRequest, EmulatedEngine]:
        engine = EmulatedEngine(make_profile(), mode="decode", time_scale=0)
        request = engine.begin_bootstrap(EmuRequest(ids(20), 4, rid="waiting"))
        assert len(engine.bootstrapping) == 1 and not engine.flush_cache()
        assert engine.abort("waiting") == 1
        return request, engine

    request, engine = asyncio.run(main())
    assert request.finish_reason["type"] == "abort" and not engine.bootstrapping
    assert engine.flush_cache()
