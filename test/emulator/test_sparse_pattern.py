"""The attention-pattern term of the emulator, the sparse flags and where they are reported.

Pure and fast: the cost model, the KV pool through the engine's scheduler (time scale 0), the
flag parser and the status bodies built in-process; one live worker checks the HTTP routes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import pytest
from emu_helpers import ids, request, small_profile, start_emulator

from omniinfer.emulator import cli, status
from omniinfer.emulator.engine import EmulatedEngine, EmuRequest
from omniinfer.emulator.interfaces import PrefillItem
from omniinfer.emulator.profile import Profile, ProfileError, load_profile, profile_from_dict
from omniinfer.emulator.sparse import AttnPattern, MoeConfig

HALF = AttnPattern(compressed_fraction=0.5, sink=128, recent=384)  # window 512


def make_profile(pattern: AttnPattern | None = None, pool: int = 100_000, ratio: float = 0.7) -> Profile:
    return small_profile(
        "pattern", {"max_total_tokens": pool, "chunked_prefill_size": 100_000,
                    "max_prefill_tokens": 100_000, "new_token_ratio": ratio},
        cost={"prefill_attention_s": 1e-7},
        transfer={"kv_bytes_per_token": 1000.0, "bandwidth_gb_s": 1.0, "latency_s": 0.01},
        attn_pattern=pattern or AttnPattern(),
    )


def test_no_pattern_is_exactly_the_dense_figures() -> None:
    dense = AttnPattern()
    assert not dense.active and dense.compressed_fraction == 0.0
    assert dense.kv_tokens(5000) == 5000 and isinstance(dense.kv_tokens(5000), int)
    assert dense.window_tokens(5000) == 0
    assert dense.attention_pairs(300, 700) == 300 * (700 + 300 / 2.0)
    cost = make_profile().cost_model()
    assert cost.prefill_time([PrefillItem(300, 700)]) == pytest.approx(0.01 + 0.001 * 300 + 1e-7 * 300 * 850,
                                                                         rel=1e-12)
    assert cost.transfer_time(4096) == 0.01 + 4096 * 1000.0 / 1e9


def test_kv_tokens_keep_full_layers_whole_and_compressed_layers_sink_plus_recent() -> None:
    assert HALF.window == 512
    assert HALF.kv_tokens(400) == 400  # shorter than the window: nothing dropped
    assert HALF.kv_tokens(4096) == 0.5 * 4096 + 0.5 * 512
    assert AttnPattern(compressed_fraction=1.0, sink=4, recent=60).kv_tokens(10_000) == 64


def test_pattern_shrinks_prefill_attention() -> None:
    # queries at positions 0..2000 attend min(p, 512) keys in the compressed half:
    # 512²/2 + (2000 - 512)·512 = 892,928 pairs against 2000²/2 = 2,000,000
    assert HALF.attention_pairs(2000, 0) == pytest.approx(0.5 * 2_000_000 + 0.5 * 892_928)
    assert HALF.attention_pairs(100, 1000) == pytest.approx(0.5 * 100 * 1050 + 0.5 * 100 * 512)
    assert HALF.attention_pairs(200, 100) == pytest.approx(200 * 200)  # inside the window: dense
    dense, sparse = make_profile().cost_model(), make_profile(HALF).cost_model()
    item = [PrefillItem(2000, 0)]
    saved = 1e-7 * (2_000_000 - (0.5 * 2_000_000 + 0.5 * 892_928))
    assert dense.prefill_time(item) - sparse.prefill_time(item) == pytest.approx(saved)


def test_pattern_shrinks_pd_transfer_bytes() -> None:
    dense, sparse = make_profile().cost_model(), make_profile(HALF).cost_model()
    assert dense.kv_bytes(4096) == 4096 * 1000.0
    assert sparse.kv_bytes(4096) == (0.5 * 4096 + 0.5 * 512) * 1000.0
    assert sparse.transfer_time(4096) == pytest.approx(0.01 + (0.5 * 4096 + 0.5 * 512) * 1000.0 / 1e9)
    assert sparse.transfer_time(300) == dense.transfer_time(300)  # a short prompt moves whole


def admitted(pattern: AttnPattern | None) -> tuple[list[EmuRequest], EmulatedEngine]:
    """The 3000-token prompts (100 new tokens, half reserved) one prefill batch admits."""
    engine = EmulatedEngine(make_profile(pattern, pool=10_000, ratio=0.5), time_scale=0)
    engine.kv.tree = None  # admission alone decides
    for i in range(8):
        engine.submit(EmuRequest(ids(3000, 10_000 * (i + 1)), 100))
    return [r for r, _ in engine._schedule_prefill()], engine


def test_pattern_admits_more_requests_into_the_same_pool() -> None:
    # dense: 3000 + 50 reserved = 3050 per request -> 3 fit in 10,000
    batch, engine = admitted(None)
    assert len(batch) == 3 and engine.kv.used() == 9000 and engine.kv.reserved_for(batch) == 3 * 50
    # half compressed: each takes 0.5·3000 + 0.5·512 = 1756 and reserves 0.5·50 (its window is
    # already full) = 1781 at admission; after five, 10,000 - 5 x 1756 = 1220 < 1781
    batch, engine = admitted(HALF)
    assert len(batch) == 5 and engine.kv.reserved_for(batch) == 5 * 25
    assert engine.kv.window_tokens == 5 * 512
    assert engine.kv.used() == math.ceil(0.5 * 15_000 + 0.5 * 5 * 512)
    assert engine.kv.footprint(3100) == 0.5 * 3100 + 0.5 * 512
    # a short prompt's reserve grows its compressed layers too, up to the window
    short = EmuRequest(ids(300, 1), 200)  # reserves 100 output tokens
    assert engine.kv.allocate(short, 300) and engine.kv.reserved_for([short]) == 0.5 * 100 + 0.5 * (400 - 300)
    assert engine.kv.admission_need(EmuRequest(ids(300, 1), 200), 200, 100) == (
        0.5 * 200 + 0.5 * 300 + 0.5 * 100 + 0.5 * (400 - 300))  # 100 cached: the window is charged whole


def test_a_request_too_long_for_the_dense_pool_fits_with_the_pattern() -> None:
    long = EmuRequest(ids(12_000, 1), 10)  # 12,010 tokens against a 10,000-token pool
    with pytest.raises(ValueError, match="more than this worker's pool"):
        EmulatedEngine(make_profile(pool=10_000), time_scale=0).submit(long)
    engine = EmulatedEngine(make_profile(HALF, pool=10_000), time_scale=0)
    assert engine.submit(EmuRequest(ids(12_000, 1), 10)).max_new_tokens == 10  # 0.5·12,010 + 256


def test_decode_reads_less_kv_and_the_pool_balances_back_to_zero() -> None:
    async def main(pattern: AttnPattern | None) -> EmulatedEngine:
        engine = EmulatedEngine(make_profile(pattern), time_scale=0)
        engine.kv.tree = None
        r = engine.submit(EmuRequest(ids(2000, 1000), 4))
        engine.start()
        while not r.finished:
            await r.wait_progress()
        await engine.stop()
        return engine

    dense, sparse = asyncio.run(main(None)), asyncio.run(main(HALF))
    cost = sparse.cost
    steps = [cost.decode_time(1, 0.5 * (2000 + k) + 0.5 * 512) for k in range(1, 4)]
    assert sparse.stats.decode_busy_s == pytest.approx(sum(steps))
    assert dense.stats.decode_busy_s == pytest.approx(sum(cost.decode_time(1, 2000 + k) for k in range(1, 4)))
    assert sparse.stats.decode_busy_s < dense.stats.decode_busy_s
    assert sparse.stats.prefill_busy_s < dense.stats.prefill_busy_s  # the attention term
    assert sparse.kv.window_tokens == 0 and sparse.kv.used() == 0 and sparse.kv.private_tokens == 0


def test_pattern_settings_in_a_profile_and_refused_values() -> None:
    raw = {"model": {"model_path": "m"}, "attn_pattern": {"compressed_fraction": 0.25, "recent": 64}}
    pattern = profile_from_dict(raw).attn_pattern
    assert (pattern.compressed_fraction, pattern.sink, pattern.recent) == (0.25, 128, 64)
    for bad in ({"compressed_fraction": 1.5}, {"recent": 0}):
        with pytest.raises(ProfileError, match="attn_pattern"):
            profile_from_dict({"model": {"model_path": "m"}, "attn_pattern": bad})


# ---------------------------------------------------------------------------- flags and status


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["emulate-worker", "--profile", "cpu-smollm2", "--port", "1", *flags])


def test_no_flag_leaves_the_profile_alone() -> None:
    profile = load_profile("cpu-smollm2")
    assert cli.sparse_from_args(parse(), profile) == profile
    assert profile.moe == MoeConfig() and profile.attn_pattern == AttnPattern()


def test_flags_set_both_terms_and_server_info_shows_them_live() -> None:
    args = parse("--moe-share", "0.3", "--moe-placement", "static", "--moe-redundant", "8",
                 "--moe-skew", "1.5", "--moe-window-steps", "2", "--moe-model", "olmoe",
                 "--attn-compressed-fraction", "0.5", "--attn-sink", "64", "--attn-recent", "448")
    profile = cli.sparse_from_args(args, load_profile("cpu-smollm2"))
    moe, pattern = profile.moe, profile.attn_pattern
    assert (moe.share, moe.placement, moe.redundant, moe.skew, moe.window_steps) == (0.3, "static", 8, 1.5, 2)
    assert (moe.ranks, moe.eplb_period, moe.b_ref) == (8, 10, 1.0)  # untouched: the defaults
    assert pattern == AttnPattern(0.5, 64, 448)
    engine = EmulatedEngine(profile, time_scale=0)
    assert engine.moe is not None
    for _ in range(5):
        engine.moe.step(0.0)
    info = status.WorkerInfo(profile, "null", "127.0.0.1", 1, 8998, 1.0)
    body = status.server_info(info, engine)["emulator_sparse"]
    assert body == status.sparse(info, engine)
    assert body["moe"]["share"] == 0.3 and body["moe"]["placement"] == "static" and body["moe"]["active"]
    assert body["moe"]["steps"] == 5 and body["moe"]["window"] == 3 and body["moe"]["b"] > 1.0
    assert {"b_mean", "rebalances", "experts_moved", "bytes_moved", "stalls", "stall_s",
            "migrations_pending"} <= set(body["moe"])
    assert body["attn_pattern"]["active"] and body["attn_pattern"]["window"] == 512
    json.dumps(body)  # a JSON body


def test_server_info_of_a_default_worker_says_off() -> None:
    profile = load_profile("cpu-smollm2")
    engine = EmulatedEngine(profile, time_scale=0)
    body = status.sparse(status.WorkerInfo(profile, "null", "127.0.0.1", 1, 8998, 1.0), engine)
    assert body["moe"]["active"] is False and body["moe"]["share"] == 0.0
    assert body["attn_pattern"]["active"] is False and body["attn_pattern"]["window_tokens_held"] == 0


def test_bad_sparse_flag_is_refused_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse("--moe-ranks", "3", "--moe-share", "0.5")) == 2
    assert "--moe-*" in capsys.readouterr().err
    assert cli.run(parse("--attn-compressed-fraction", "2")) == 2
    with pytest.raises(SystemExit):
        parse("--moe-placement", "round-robin")


def test_live_worker_reports_the_sparse_state(tmp_path: Path) -> None:
    emu = start_emulator(tmp_path, "--moe-share", "0.5", "--moe-placement", "static",
                         "--moe-redundant", "8", "--moe-window-steps", "2",
                         "--attn-compressed-fraction", "0.5")
    try:
        code, text = request(emu.url + "/server_info")
        assert code == 200
        sparse = json.loads(text)["emulator_sparse"]
        assert sparse["moe"]["placement"] == "static" and sparse["attn_pattern"]["compressed_fraction"] == 0.5
        body = {"text": "hello there", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        assert request(emu.url + "/generate", "POST", body)[0] == 200
        code, text = request(emu.url + "/emulator/sparse")
        live = json.loads(text)["moe"]
        assert code == 200 and live["steps"] == 5 and live["window"] == 3 and live["b"] > 1.0
    finally:
        emu.stop()
