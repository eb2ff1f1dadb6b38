"""Workload builders: exact lengths, real prefix sharing, trace parsing and its errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omniinfer.bench.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    WorkloadSpec,
    as_word_text,
    azure,
    describe,
    id_word,
    mooncake,
    paper,
    random_ids,
    shared_prefix,
)

SPECIAL = frozenset({0, 1, 2})


def test_random_ids_have_exact_lengths_and_avoid_special_tokens() -> None:
    reqs = random_ids(WorkloadSpec(num_requests=20, input_len=50, output_len=9, range_ratio=0.5,
                                   vocab_size=100, special_ids=SPECIAL))
    assert len(reqs) == 20
    for r in reqs:
        assert r.input_ids is not None and len(r.input_ids) == r.prompt_tokens
        assert 25 <= r.prompt_tokens <= 50 and 4 <= r.output_tokens <= 9
        assert not SPECIAL & set(r.input_ids)
    again = random_ids(WorkloadSpec(num_requests=20, input_len=50, output_len=9, range_ratio=0.5,
                                    vocab_size=100, special_ids=SPECIAL))
    assert again == reqs  # seeded


def test_paper_workload_matches_the_papers_shape() -> None:
    stats = describe(paper(WorkloadSpec(num_requests=2000, seed=3)))
    assert 3000 <= stats["mean_input_tokens"] <= 3800
    assert 850 <= stats["mean_output_tokens"] <= 1100
    reqs = paper(WorkloadSpec(num_requests=2000, seed=3))
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) < 16_000
    # long-tailed: the 99th percentile input is far above the mean
    assert stats["p99_input_tokens"] > 2.5 * stats["mean_input_tokens"]


def test_shared_prefix_groups_share_their_prefix() -> None:
    reqs = shared_prefix(WorkloadSpec(num_requests=12, input_len=10, output_len=4, prefix_len=32,
                                      num_groups=3, vocab_size=500))
    prefixes = {r.input_ids[:32] for r in reqs if r.input_ids}
    assert len(prefixes) == 3
    assert all(r.prompt_tokens == 42 for r in reqs)


def test_mooncake_equal_hash_ids_become_equal_token_prefixes() -> None:
    reqs = mooncake(WorkloadSpec(num_requests=6, vocab_size=1000))
    # The first requests of the shipped trace share hash id 0 and nothing else.
    a, b = reqs[0], reqs[1]
    assert a.input_ids is not None and b.input_ids is not None
    assert a.input_ids[:MOONCAKE_BLOCK_TOKENS] == b.input_ids[:MOONCAKE_BLOCK_TOKENS]
    assert a.input_ids[MOONCAKE_BLOCK_TOKENS:2 * MOONCAKE_BLOCK_TOKENS] != \
        b.input_ids[MOONCAKE_BLOCK_TOKENS:2 * MOONCAKE_BLOCK_TOKENS]
    assert [r.prompt_tokens for r in reqs[:2]] == [6758, 7322]
    assert all(len(r.input_ids or ()) == r.prompt_tokens for r in reqs)


def test_mooncake_scaling_keeps_prefix_structure() -> None:
    reqs = mooncake(WorkloadSpec(num_requests=3, vocab_size=1000, input_scale=0.01, output_scale=0.1))
    block = 5  # 512 × 0.01
    assert reqs[0].prompt_tokens == 68 and reqs[0].output_tokens == 50
    assert reqs[0].input_ids[:block] == reqs[1].input_ids[:block]
    assert reqs[0].input_ids[block:2 * block] != reqs[1].input_ids[block:2 * block]


def test_azure_trace_arrivals_and_lengths() -> None:
    reqs = azure(WorkloadSpec(num_requests=50, vocab_size=1000))
    assert reqs[0].arrival_s == 0.0 and reqs[0].prompt_tokens == 374
    assert reqs[1].arrival_s == pytest.approx(4.3145788, abs=1e-3)
    arrivals = np.array([r.arrival_s for r in reqs])
    assert np.all(np.diff(arrivals) >= 0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length"',
         ":2: not valid JSON"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 2}\n', ":1: input_length must be >= 0"),
        ('{"timestamp": 0, "output_length": 2}\n', ":1: missing field 'input_length'"),
        ('[1, 2]\n', ":1: expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": "x"}\n',
         ":1: hash_ids must be a list"),
    ],
)
def test_bad_mooncake_files_name_the_line(tmp_path: Path, text: str, fragment: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(text)
    with pytest.raises(TraceError) as info:
        mooncake(WorkloadSpec(trace=trace, vocab_size=100))
    assert fragment in str(info.value) and str(trace) in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,3\n", ":1: missing column(s) GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,3,1\n"
         "2023-11-16 18:15:47.68,-3,1\n", ":3: negative token count"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-time,3,1\n", ":2:"),
    ],
)
def test_bad_azure_files_name_the_line(tmp_path: Path, text: str, fragment: str) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(TraceError) as info:
        azure(WorkloadSpec(trace=trace, vocab_size=100))
    assert fragment in str(info.value)


def test_missing_trace_file_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        mooncake(WorkloadSpec(trace=tmp_path / "absent.jsonl", vocab_size=100))


def test_word_text_keeps_prefixes_and_token_counts() -> None:
    from omniinfer.emulator.tokenizer import EmulatedTokenizer

    words = {id_word(t) for t in range(26**2 + 26 + 5)}
    assert len(words) == 26**2 + 26 + 5  # no two ids share a word
    assert id_word(0) == " a" and id_word(25) == " z" and id_word(26) == " aa"
    assert len(id_word(26**5 - 1)) <= 6
    with pytest.raises(ValueError):
        id_word(26**5)
    rows = mooncake(WorkloadSpec(num_requests=40, vocab_size=49152, input_scale=0.05))
    texts = as_word_text(rows)
    tokenizer = EmulatedTokenizer(49152)
    for row, text in zip(rows, texts, strict=True):
        assert text.input_ids is None and text.prompt is not None
        assert len(tokenizer.encode(text.prompt)) == row.prompt_tokens
    shared = [(a, b) for a in range(40) for b in range(a) if rows[a].input_ids[:20] == rows[b].input_ids[:20]]
    assert shared, "the trace's first rows share hashed blocks"
    for a, b in shared:
        head = "".join(id_word(t) for t in rows[a].input_ids[:20])
        assert texts[a].prompt.startswith(head) and texts[b].prompt.startswith(head)
