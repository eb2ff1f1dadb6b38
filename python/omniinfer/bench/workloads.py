"""Workloads: what to send, how long the prompt is, how many tokens to generate, and when.

Prompts are token ids wherever the trace defines only lengths, so the server sees exactly the
number of prompt tokens the benchmark reports, and equal Mooncake hash ids become equal token
prefixes (prefix sharing in the trace is real prefix sharing at the server).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A bad trace file; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Exactly one of ``input_ids`` / ``prompt`` is the source."""

    index: int
    prompt_tokens: int
    output_tokens: int
    input_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    arrival_s: float = 0.0  # offset from the start of the trace (open-loop replay)
    after: int | None = None  # sent only once this request (an earlier turn) is answered
    think_s: float = 0.0  # ... and this long after that answer
    group: int | None = None  # shared-prefix group or conversation, for per-group figures


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Everything a workload builder may need; builders ignore what they do not use."""

    num_requests: int | None = None
    input_len: int = 128
    output_len: int = 32
    range_ratio: float = 1.0
    seed: int = 0
    trace: Path | None = None
    input_scale: float = 1.0
    output_scale: float = 1.0
    prefix_len: int = 512
    num_groups: int = 8
    vocab_size: int = 32000
    special_ids: frozenset[int] = frozenset()
    max_total_len: int | None = None
    users_per_group: int = 5
    query_len: int = 128
    conversations: int = 16
    turns: int = 4
    turn_len: int = 128
    think_s: float = 0.0


def packaged_trace(name: str) -> Path:
    """Path of a trace shipped with the package ('mooncake' or 'azure')."""
    files = {
        "mooncake": "traces/mooncake/conversation_trace.jsonl",
        "azure": "traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
    }
    return Path(str(resources.files("omniinfer.data").joinpath(files[name])))


class TokenSource:
    """Deterministic token blocks: the same key always yields the same ids."""

    def __init__(self, vocab_size: int, special_ids: frozenset[int], seed: int) -> None:
        if vocab_size < 16:
            raise ValueError(f"vocab_size {vocab_size} is too small")
        allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
        self.allowed = allowed
        self.seed = seed

    def block(self, key: int, length: int) -> list[int]:
        # Keys below zero (shared prefixes) live in their own range of the seed space.
        rng = np.random.default_rng([self.seed, key if key >= 0 else 2**62 - key])
        return self.allowed[rng.integers(0, len(self.allowed), length)].tolist()


def _scaled(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


def _clip(n_in: int, n_out: int, spec: WorkloadSpec) -> tuple[int, int]:
    if spec.max_total_len is not None and n_in + n_out > spec.max_total_len:
        n_in = max(1, spec.max_total_len - n_out)
        n_out = min(n_out, spec.max_total_len - n_in)
    return n_in, n_out


def random_ids(spec: WorkloadSpec) -> list[BenchRequest]:
    """Random token ids, lengths uniform in [ratio·len, len] (sglang's `random-ids`)."""
    n = spec.num_requests or 100
    if spec.input_len < 1 or spec.output_len < 1:
        raise ValueError("--input-len and --output-len must be positive")
    if not 0.0 < spec.range_ratio <= 1.0:
        raise ValueError("--range-ratio must be in (0, 1]")
    rng = random.Random(spec.seed)
    tokens = TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    out = []
    for i in range(n):
        n_in = rng.randint(max(1, int(spec.input_len * spec.range_ratio)), spec.input_len)
        n_out = rng.randint(max(1, int(spec.output_len * spec.range_ratio)), spec.output_len)
        n_in, n_out = _clip(n_in, n_out, spec)
        out.append(BenchRequest(i, n_in, n_out, input_ids=tuple(tokens.block(i, n_in))))
    return out


def paper(spec: WorkloadSpec) -> list[BenchRequest]:
    """The paper's synthetic mix: mean input ≈3.5K, mean output ≈1K, long-tailed, total < 16K.

    Lognormal lengths (sigma 0.8 for input, 0.9 for output) with the mean fixed by mu; pairs with
    input + output ≥ 16K are redrawn, which trims the tail slightly (the realized means are
    reported by `describe`). Scales apply after drawing.
    """
    n = spec.num_requests or 200
    rng = np.random.default_rng(spec.seed)
    tokens = TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    limit = 16_000
    out = []
    for i in range(n):
        while True:
            n_in = int(rng.lognormal(math.log(3500) - 0.8**2 / 2, 0.8))
            n_out = int(rng.lognormal(math.log(1000) - 0.9**2 / 2, 0.9))
            if n_in >= 1 and n_out >= 1 and n_in + n_out < limit:
                break
        n_in, n_out = _clip(_scaled(n_in, spec.input_scale), _scaled(n_out, spec.output_scale), spec)
        out.append(BenchRequest(i, n_in, n_out, input_ids=tuple(tokens.block(i, n_in))))
    return out


def shared_prefix(spec: WorkloadSpec) -> list[BenchRequest]:
    """Groups of requests sharing a system prompt (sglang's generated-shared-prefix shape)."""
    n = spec.num_requests or 64
    if spec.num_groups < 1:
        raise ValueError("--num-groups must be >= 1")
    tokens = TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    rng = random.Random(spec.seed)
    out = []
    for i in range(n):
        group = i % spec.num_groups
        prefix = tokens.block(-1 - group, spec.prefix_len)
        suffix = tokens.block(i, spec.input_len)
        n_out = rng.randint(max(1, int(spec.output_len * spec.range_ratio)), spec.output_len)
        ids = prefix + suffix
        out.append(BenchRequest(i, len(ids), n_out, input_ids=tuple(ids)))
    rng.shuffle(out)
    return [dataclasses.replace(r, index=i) for i, r in enumerate(out)]


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, row


def _non_negative_int(path: Path, lineno: int, row: dict[str, object], key: str) -> int:
    if key not in row:
        raise TraceError(f"{path}:{lineno}: missing field {key!r}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TraceError(f"{path}:{lineno}: {key} must be an integer, got {value!r}")
    if value < 0:
        raise TraceError(f"{path}:{lineno}: {key} must be >= 0, got {value}")
    return int(value)


def mooncake(spec: WorkloadSpec) -> list[BenchRequest]:
    """Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids (512-token blocks).

    Block ``h`` of every request is the same token ids, so requests that share hash ids share a
    real token prefix. With --input-scale the block size shrinks with the lengths.
    """
    path = spec.trace or packaged_trace("mooncake")
    tokens = TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    block = max(1, int(round(MOONCAKE_BLOCK_TOKENS * spec.input_scale)))
    out: list[BenchRequest] = []
    for lineno, row in _jsonl_rows(path):
        ts = _non_negative_int(path, lineno, row, "timestamp")
        n_in = _non_negative_int(path, lineno, row, "input_length")
        n_out = _non_negative_int(path, lineno, row, "output_length")
        hashes = row.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise TraceError(f"{path}:{lineno}: hash_ids must be a list of integers")
        n_in, n_out = _scaled(n_in, spec.input_scale), _scaled(n_out, spec.output_scale)
        n_in, n_out = _clip(n_in, n_out, spec)
        ids: list[int] = []
        for h in hashes:
            if len(ids) >= n_in:
                break
            ids.extend(tokens.block(h, block))
        if len(ids) < n_in:  # tail beyond the hashed blocks: unique to this request
            ids.extend(tokens.block(10**12 + len(out), n_in - len(ids)))
        out.append(BenchRequest(len(out), n_in, n_out, tuple(ids[:n_in]), arrival_s=ts / 1000.0))
        if spec.num_requests is not None and len(out) >= spec.num_requests:
            break
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def azure(spec: WorkloadSpec) -> list[BenchRequest]:
    """Azure LLM inference trace CSV: TIMESTAMP, ContextTokens, GeneratedTokens."""
    path = spec.trace or packaged_trace("azure")
    tokens = TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    try:
        handle = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open: {exc.strerror}") from None
    out: list[BenchRequest] = []
    start: dt.datetime | None = None
    with handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(sorted(missing))}")
        for row in reader:
            lineno = reader.line_num
            try:
                stamp = dt.datetime.fromisoformat(row["TIMESTAMP"][:26])
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
            if n_in < 0 or n_out < 0:
                raise TraceError(f"{path}:{lineno}: negative token count")
            start = start or stamp
            n_in, n_out = _scaled(n_in, spec.input_scale), _scaled(n_out, spec.output_scale)
            n_in, n_out = _clip(n_in, n_out, spec)
            ids = tuple(tokens.block(len(out), n_in))
            arrival = (stamp - start).total_seconds()
            out.append(BenchRequest(len(out), n_in, n_out, ids, arrival_s=arrival))
            if spec.num_requests is not None and len(out) >= spec.num_requests:
                break
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def text_corpus(spec: WorkloadSpec, tokenizer: object) -> list[BenchRequest]:
    """Prompts cut from real text (Shakespeare) at random offsets; needs the tokenizer."""
    n = spec.num_requests or 16
    corpus = resources.files("omniinfer.data").joinpath("text/tinyshakespeare.txt").read_text("utf-8")
    ids = tokenizer.encode(corpus[:400_000], add_special_tokens=False)  # type: ignore[attr-defined]
    if len(ids) <= spec.input_len:
        raise ValueError(f"--input-len {spec.input_len} exceeds the corpus ({len(ids)} tokens)")
    rng = random.Random(spec.seed)
    out = []
    for i in range(n):
        n_in = rng.randint(max(1, int(spec.input_len * spec.range_ratio)), spec.input_len)
        n_out = rng.randint(max(1, int(spec.output_len * spec.range_ratio)), spec.output_len)
        start = rng.randrange(0, len(ids) - n_in)
        prompt = tokenizer.decode(ids[start : start + n_in])  # type: ignore[attr-defined]
        real = len(tokenizer.encode(prompt, add_special_tokens=False))  # type: ignore[attr-defined]
        out.append(BenchRequest(i, real, n_out, prompt=prompt))
    return out


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    """Open-loop arrival times at ``rate`` requests per second (seeded Poisson process).

    Requests that follow another (``after``) arrive when it is answered, so only the first
    turns get times: they come at ``rate`` × (first turns / all requests), which keeps the
    overall request rate at ``rate`` while every conversation runs.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    first = [r for r in requests if r.after is None]
    rng = random.Random(seed)
    per_start = rate * len(first) / max(1, len(requests))
    t = 0.0
    times: dict[int, float] = {}
    for r in first:
        t += rng.expovariate(per_start)
        times[r.index] = t
    return [dataclasses.replace(r, arrival_s=times.get(r.index, 0.0)) for r in requests]


def id_word(token: int) -> str:
    """`` `` plus a word of at most five letters that names ``token`` (base 26, ``a`` = 0).

    Distinct ids give distinct words, and each word is one piece of the emulated tokenizer
    (``omniinfer.emulator.tokenizer``: a letter run of at most five letters with its leading
    space), so the text of ``n`` ids is ``n`` emulated tokens. Ids below 26**5 only.
    """
    if not 0 <= token < 26**5:
        raise ValueError(f"token id {token} has no five-letter word")
    letters = ""
    while True:
        token, digit = divmod(token, 26)
        letters = chr(97 + digit) + letters
        if token == 0:
            return " " + letters
        token -= 1  # bijective numbering: "a".."z", then "aa".., so no two ids share a word


def as_word_text(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The requests with their token ids sent as text, one word per id (:func:`id_word`).

    For routers whose prefix trees match text (smg's ``cache_aware``): requests that share an
    id prefix share a text prefix, and an emulated worker reads back the same number of tokens.
    Requests already holding text are kept as they are.
    """
    return [r if r.input_ids is None else dataclasses.replace(
        r, input_ids=None, prompt="".join(id_word(t) for t in r.input_ids)) for r in requests]


Builder = Callable[[WorkloadSpec], list[BenchRequest]]
WORKLOADS: dict[str, Builder] = {
    "random": random_ids,
    "paper": paper,
    "shared-prefix": shared_prefix,
    "mooncake": mooncake,
    "azure": azure,
}
TEXT_WORKLOADS = {"text": text_corpus}
TRACE_WORKLOADS = {"mooncake", "azure"}


def describe(requests: Sequence[BenchRequest]) -> dict[str, float]:
    ins = np.array([r.prompt_tokens for r in requests], dtype=float)
    outs = np.array([r.output_tokens for r in requests], dtype=float)
    return {
        "num_requests": float(len(requests)),
        "mean_input_tokens": float(ins.mean()),
        "p99_input_tokens": float(np.percentile(ins, 99)),
        "mean_output_tokens": float(outs.mean()),
        "p99_output_tokens": float(np.percentile(outs, 99)),
        "span_s": float(max(r.arrival_s for r in requests)),
    }
