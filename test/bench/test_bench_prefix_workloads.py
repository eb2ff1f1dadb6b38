"""prefix-groups and multi-turn: shapes, determinism, real text, open-loop turn order.

The end-to-end test drives one emulated worker (the project's fake SGLang worker) through
``omniinfer bench`` and checks what its prefix cache saw: later turns and later rounds hit it.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest

from omniinfer.bench.prefix_workloads import multi_turn, prefix_groups
from omniinfer.bench.runner import Turns
from omniinfer.bench.workloads import BenchRequest, WorkloadSpec, poisson_arrivals
from omniinfer.child_process import ManagedProcess, free_port
from omniinfer.cli import main


class WordTokenizer:
    """A stand-in with the one call the workloads make: one id per word of the text."""

    name_or_path = ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert add_special_tokens is False
        return [zlib.crc32(w.encode()) % 30000 + 3 for w in text.split()]


GROUPS = WorkloadSpec(num_groups=3, prefix_len=40, users_per_group=2, query_len=12,
                      output_len=5, num_requests=18, vocab_size=500)


def test_prefix_groups_are_prefix_plus_fresh_query_in_rounds() -> None:
    reqs = prefix_groups(GROUPS)
    assert len(reqs) == 18 and all(r.prompt_tokens == 52 and r.output_tokens == 5 for r in reqs)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        assert r.input_ids is not None and r.group is not None
        by_group.setdefault(r.group, set()).add(r.input_ids[:40])
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # one prefix per group
    assert len({next(iter(p)) for p in by_group.values()}) == 3  # and no two groups share it
    assert len({r.input_ids[40:] for r in reqs if r.input_ids}) == 18  # every query is fresh
    # a round is every user of every group once: 3 groups × 2 users = 6 requests
    for start in range(0, 18, 6):
        assert Counter(r.group for r in reqs[start:start + 6]) == {0: 2, 1: 2, 2: 2}
    assert prefix_groups(GROUPS) == reqs
    assert prefix_groups(WorkloadSpec(**{**GROUPS.__dict__, "seed": 1})) != reqs


def test_prefix_groups_default_is_one_round_and_bad_sizes_are_refused() -> None:
    assert len(prefix_groups(WorkloadSpec(num_groups=4, users_per_group=3, prefix_len=8,
                                          query_len=4, vocab_size=100))) == 12
    with pytest.raises(ValueError, match="--users-per-group must be >= 1"):
        prefix_groups(WorkloadSpec(users_per_group=0))
    with pytest.raises(ValueError, match="exceeds --max-total-len"):
        prefix_groups(WorkloadSpec(prefix_len=100, query_len=10, output_len=10,
                                   max_total_len=100))


def test_multi_turn_extends_the_previous_prompt_and_answer() -> None:
    spec = WorkloadSpec(conversations=3, turns=4, turn_len=10, output_len=6, think_s=0.5,
                        vocab_size=500)
    reqs = multi_turn(spec)
    assert len(reqs) == 12
    chats: dict[int, list[BenchRequest]] = {}
    for r in reqs:
        chats.setdefault(r.group or 0, []).append(r)
    for chat in chats.values():
        assert [r.prompt_tokens for r in chat] == [10, 26, 42, 58]  # + answer 6 + message 10
        assert chat[0].after is None and chat[0].think_s == 0.0
        for before, turn in zip(chat, chat[1:], strict=False):
            assert turn.after == before.index and turn.think_s == 0.5
            assert turn.input_ids is not None and before.input_ids is not None
            assert turn.input_ids[:before.prompt_tokens] == before.input_ids
    assert len({r.input_ids for r in reqs if r.after is None}) == 3
    with pytest.raises(ValueError, match="--max-total-len"):
        multi_turn(WorkloadSpec(turns=8, turn_len=100, output_len=100, max_total_len=1000))


def test_text_prompts_come_from_the_corpus_and_are_deterministic() -> None:
    tok = WordTokenizer()
    reqs = prefix_groups(GROUPS, tok)
    corpus = tok.encode("\n".join(
        (Path(__file__).resolve().parents[2] / "python/omniinfer/data/text" / n).read_text()
        for n in ("paradise_lost.txt", "tinyshakespeare.txt")))
    text = ",".join(map(str, corpus))
    assert reqs[0].input_ids is not None
    # the prefix is a contiguous run of the tokenized books
    assert ",".join(map(str, reqs[0].input_ids[:40])) in text
    assert prefix_groups(GROUPS, tok) == reqs


def test_poisson_arrivals_time_first_turns_only() -> None:
    reqs = multi_turn(WorkloadSpec(conversations=200, turns=2, turn_len=4, output_len=2,
                                   vocab_size=100))
    timed = poisson_arrivals(reqs, rate=10.0, seed=0)
    starts = [r.arrival_s for r in timed if r.after is None]
    assert all(r.arrival_s == 0.0 for r in timed if r.after is not None)
    # 200 chats of 2 turns at 10 requests/s: chats start at 5/s, so over about 40 s
    assert 30 < max(starts) < 50 and starts == sorted(starts)
    assert poisson_arrivals(reqs, 10.0, 0) == timed
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(reqs, 0.0, 0)


def test_turns_refuse_a_request_that_follows_a_later_one() -> None:
    with pytest.raises(ValueError, match="follows 1"):
        Turns([BenchRequest(0, 1, 1, (1,), after=1), BenchRequest(1, 1, 1, (1,))])


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    port = free_port()
    log = tmp_path_factory.mktemp("emulator") / "worker.log"
    proc = ManagedProcess([sys.executable, "-m", "omniinfer.emulator", "--profile",
                           "h100-llama3-8b", "--port", str(port), "--time-scale", "0.2"],
                          dict(os.environ), log, port, ready_timeout_s=60)
    with proc:
        yield proc


@pytest.mark.parametrize("mode", [["--request-rate", "40"], ["--concurrency", "3"]])
def test_turns_wait_for_their_answer_and_hit_the_cache(worker, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                       mode: list[str]) -> None:
    out = tmp_path / "run"
    code = main(["bench", "--base-url", worker.base_url, "--workload", "multi-turn",
                 "--conversations", "4", "--turns", "3", "--turn-len", "64", "--output-len", "8",
                 "--think-time", "0.05", *mode, "--output-dir", str(out), "--no-progress"])
    assert code == 0
    rows = {r["index"]: r for r in map(json.loads, (out / "requests.jsonl").read_text()
                                       .splitlines())}
    reqs = multi_turn(WorkloadSpec(conversations=4, turns=3, turn_len=64, output_len=8,
                                   vocab_size=32000))
    assert len(rows) == 12 and all(r["error"] is None for r in rows.values())
    for r in reqs:
        if r.after is None:
            continue
        before = rows[r.after]
        assert rows[r.index]["start"] >= before["end"] + 0.05 - 1e-3  # answered, then thought
        # the worker kept the previous prompt: all of it is reused (SGLang recomputes the last)
        assert rows[r.index]["cached_tokens"] >= before["prompt_tokens"] - 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cached_token_share"] > 0.4


def test_prefix_groups_open_loop_reuses_group_prefixes(worker, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "groups"
    code = main(["bench", "--base-url", worker.base_url, "--workload", "prefix-groups",
                 "--num-groups", "2", "--prefix-len", "256", "--users-per-group", "3",
                 "--query-len", "32", "--output-len", "4", "--num-requests", "12",
                 "--request-rate", "30", "--output-dir", str(out), "--no-progress"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    hits = sorted(r["cached_tokens"] for r in rows)
    # one worker, two groups: after each group's first request its whole prefix is cached
    assert hits[:2] == [0, 0] and all(h >= 256 for h in hits[2:])
