"""Workers the router knows: their role, health, circuit breaker and load in tokens."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from omniinfer.proxy.circuit import CircuitBreaker


class Role(str, enum.Enum):
    REGULAR = "regular"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclasses.dataclass(slots=True, frozen=True)
class RankLoad:
    """One DP rank's own report: the figures ``--dp-aware`` places a request by."""

    used_tokens: int = 0  # KV tokens the rank holds
    waiting_uncached_tokens: int = 0  # prompt tokens queued there, not yet computed
    running_reqs: int = 0


@dataclasses.dataclass(slots=True)
class WorkerLoads:
    """The worker's own view of its load, polled from SGLang's ``GET /v1/loads`` (all DP ranks
    summed; ``ranks`` keeps each rank's part, indexed by its ``dp_rank``)."""

    running_reqs: int = 0
    waiting_reqs: int = 0
    waiting_uncached_tokens: int = 0
    used_tokens: int = 0
    max_total_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    max_running_reqs: int = 0
    prefill_busy_us: int = 0  # cumulative prefill step time (SGLang's total_prefill_busy_us)
    prefill_uncached_tokens: int = 0  # cumulative (total_prefill_uncached_tokens)
    polled_at: float = 0.0
    ranks: dict[int, RankLoad] = dataclasses.field(default_factory=dict)

    def rank(self, dp_rank: int) -> RankLoad:
        """That rank's part (zeros when it has not reported)."""
        return self.ranks.get(dp_rank, _NO_RANK_LOAD)

    @classmethod
    def from_json(cls, data: Any, now: float) -> WorkerLoads:
        """Sum the per-rank entries of a /v1/loads answer; unknown shapes give zeros.

        Every figure is clamped (``load_count``, ``load_rate``): finite, non-negative and
        bounded, so no answer (``1e308``, ``-5``, ``1e400`` read as inf) can make a later sum,
        a ``/metrics`` scrape or a policy's arithmetic fail."""
        loads = cls(polled_at=now)
        ranks = data.get("loads", []) if isinstance(data, dict) else []
        usages = []
        for position, rank in enumerate(ranks if isinstance(ranks, list) else []):
            if not isinstance(rank, dict):
                continue
            loads.add_rank(rank.get("dp_rank"), position, RankLoad(
                _int(rank.get("num_used_tokens")), _int(rank.get("num_waiting_uncached_tokens")),
                _int(rank.get("num_running_reqs"))))
            loads.running_reqs += _int(rank.get("num_running_reqs"))
            loads.waiting_reqs += _int(rank.get("num_waiting_reqs"))
            loads.waiting_uncached_tokens += _int(rank.get("num_waiting_uncached_tokens"))
            loads.used_tokens += _int(rank.get("num_used_tokens"))
            loads.max_total_tokens += _int(rank.get("max_total_num_tokens"))
            loads.gen_throughput += _float(rank.get("gen_throughput"))
            loads.max_running_reqs += _int(rank.get("max_running_requests"))
            loads.prefill_busy_us += _int(rank.get("total_prefill_busy_us"))
            loads.prefill_uncached_tokens += _int(rank.get("total_prefill_uncached_tokens"))
            usages.append(_float(rank.get("token_usage")))
        loads.token_usage = max(usages, default=0.0)
        for field in _COUNT_FIELDS:  # sums of bounded ranks stay bounded
            setattr(loads, field, min(getattr(loads, field), MAX_LOAD_COUNT))
        loads.gen_throughput = min(loads.gen_throughput, MAX_LOAD_RATE)
        return loads

    def add_rank(self, dp_rank: Any, position: int, load: RankLoad) -> None:
        """Keep one rank's part under its ``dp_rank`` (its position when that is not a small
        non-negative int); at most ``MAX_DP_RANKS`` ranks are kept, a repeated rank once."""
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
            dp_rank = position
        if 0 <= dp_rank < MAX_DP_RANKS and dp_rank not in self.ranks:
            self.ranks[dp_rank] = load


_NO_RANK_LOAD = RankLoad()
MAX_DP_RANKS = 1024  # ranks one worker may have (the paper's decode instance has 64)

# requests, tokens or microseconds: 2**53 is exact in float64 (a policy's arithmetic) and far
# above any honest figure, cumulative counters included (one rank busy for 30 days is 2.6e12
# us; 2**53 us is 285 years), so clamping changes no honest worker's report
MAX_LOAD_COUNT = 2**53
MAX_LOAD_RATE = 1e12  # tokens per second, and the like


def load_count(value: Any) -> int:
    """A count a worker reported (requests, tokens, microseconds), made safe to add and show.

    Contract: an int in ``[0, MAX_LOAD_COUNT]`` for any input. Non-numbers (bool, str, None,
    containers), NaN and negatives give 0; values above the bound (``1e308``, ``inf``, a
    huge int) give ``MAX_LOAD_COUNT``; fractions are truncated. Never raises.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    if isinstance(value, float):
        if value != value or value <= 0:  # NaN, negative, zero
            return 0
        return MAX_LOAD_COUNT if value >= MAX_LOAD_COUNT else int(value)
    return min(max(value, 0), MAX_LOAD_COUNT)


def load_rate(value: Any) -> float:
    """A rate or fraction a worker reported (throughput, usage), made safe to add and show.

    Contract: a finite float in ``[0.0, MAX_LOAD_RATE]`` for any input. Non-numbers, NaN and
    negatives give 0.0; values above the bound (``inf`` included) give ``MAX_LOAD_RATE``.
    Never raises (a huge int is compared, not converted).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    if value != value or value <= 0:
        return 0.0
    return MAX_LOAD_RATE if value >= MAX_LOAD_RATE else float(value)


_int = load_count
_float = load_rate


_COUNT_FIELDS = ("running_reqs", "waiting_reqs", "waiting_uncached_tokens", "used_tokens",
                 "max_total_tokens", "max_running_reqs", "prefill_busy_us",
                 "prefill_uncached_tokens")


@dataclasses.dataclass(eq=False)
class Worker:
    """One upstream SGLang server. Load counters are in tokens, updated at dispatch/finish."""

    url: str
    role: Role
    bootstrap_port: int | None = None
    breaker: CircuitBreaker = dataclasses.field(default_factory=CircuitBreaker)
    healthy: bool = False
    health_failures: int = 0
    health_successes: int = 0
    inflight_requests: int = 0
    inflight_tokens: int = 0
    total_requests: int = 0
    loads: WorkerLoads = dataclasses.field(default_factory=WorkerLoads)
    loads_supported: bool = True
    dp_size: int = 1  # data-parallel ranks the router dispatches to (``--dp-aware``), else 1
    rank_inflight_tokens: list[int] = dataclasses.field(default_factory=lambda: [0])
    rank_requests: list[int] = dataclasses.field(default_factory=lambda: [0])  # sent, in all

    def __post_init__(self) -> None:
        self.url = normalize_url(self.url)
        self.host = urlsplit(self.url).hostname or "127.0.0.1"

    def set_dp_size(self, ranks: int) -> None:
        """The worker has ``ranks`` DP ranks (1..``MAX_DP_RANKS``); counters of ranks that
        remain are kept, bookings on ranks that went are given back by ``release_rank``."""
        if not 1 <= ranks <= MAX_DP_RANKS:
            raise ValueError(f"dp size {ranks} is not within 1..{MAX_DP_RANKS}")
        grow = max(0, ranks - len(self.rank_inflight_tokens))
        self.rank_inflight_tokens = self.rank_inflight_tokens[:ranks] + [0] * grow
        self.rank_requests = self.rank_requests[:ranks] + [0] * grow
        self.dp_size = ranks

    def book_rank(self, rank: int, tokens: int) -> None:
        self.rank_inflight_tokens[rank] += tokens
        self.rank_requests[rank] += 1

    def release_rank(self, rank: int, tokens: int) -> None:
        """Give back a rank's booking; a rank the worker no longer has is ignored."""
        if rank < len(self.rank_inflight_tokens):
            self.rank_inflight_tokens[rank] = max(0, self.rank_inflight_tokens[rank] - tokens)

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.allows(now)

    def load_tokens(self) -> int:
        """Tokens this worker still has to process for requests the router sent it."""
        return self.inflight_tokens

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url, "role": self.role.value, "bootstrap_port": self.bootstrap_port,
            "healthy": self.healthy, "circuit": self.breaker.state.name.lower(),
            "inflight_requests": self.inflight_requests, "inflight_tokens": self.inflight_tokens,
            "total_requests": self.total_requests, "loads": _loads_json(self.loads),
            **({"dp_size": self.dp_size, "rank_inflight_tokens": list(self.rank_inflight_tokens),
                "rank_requests": list(self.rank_requests)} if self.dp_size > 1 else {}),
        }


def _loads_json(loads: WorkerLoads) -> dict[str, Any]:
    data = dataclasses.asdict(loads)
    data["ranks"] = {str(r): dataclasses.asdict(v) for r, v in sorted(loads.ranks.items())}
    return data


def normalize_url(url: str) -> str:
    """The canonical ``scheme://host[:port]`` of a worker, or ValueError.

    Only http/https with a host and a valid port; no path, query, fragment or userinfo: the
    router appends SGLang's paths itself, and relays some answers, so a URL that names anything
    else would let whoever registers it read or write elsewhere. Spellings of one address give
    one URL (scheme and host in lower case, ``localhost`` and IPv4-mapped IPv6 as the IPv4
    address, IPv6 compressed, the port without leading zeros, the scheme's default port left
    out), so one worker cannot be registered twice and get two shares of the traffic. Every
    numeric IPv4 spelling the OS resolver accepts (``inet_aton``: ``127.1``, ``0x7f000001``,
    ``2130706433``, ``017700000001``) becomes its dotted quad; the unspecified address
    (``0.0.0.0``, ``::``, or any spelling of them) is refused: no client can send to it.
    The URL must be ASCII and a host name only letters, digits, ``-``, ``_`` and dots (no empty
    label; one trailing dot, the DNS root, is dropped): the HTTP client (yarl) maps Unicode
    spellings (fullwidth digits and dots, a circled letter, the ideographic full stop U+3002)
    onto ASCII addresses by IDNA, so they would name one worker twice or reach ``0.0.0.0``;
    percent-encoded hosts are refused too.
    """
    if not isinstance(url, str):
        raise ValueError("a worker URL must be a string")
    if not url.isascii():
        raise ValueError(f"not a worker URL: {url!r} (ASCII only: no Unicode host or port)")
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a worker URL: {url!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a worker URL: {url!r} (http or https, with a host)")
    if parts.path or parts.query or parts.fragment or "?" in url or "#" in url:
        raise ValueError(f"not a worker URL: {url!r} (no path, query or fragment)")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError(f"not a worker URL: {url!r} (no user information)")
    if port == 0 or any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError(f"not a worker URL: {url!r}")
    if "[" in parts.netloc and ":" not in parts.hostname:  # IPvFuture: no worker address
        raise ValueError(f"not a worker URL: {url!r} (a bracketed host is an IPv6 address)")
    host = _canonical_host(parts.hostname)
    default = 443 if parts.scheme == "https" else 80
    return f"{parts.scheme}://{host}" + ("" if port in (None, default) else f":{port}")


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _canonical_host(host: str) -> str:
    """``host`` (``urlsplit``'s lower-case hostname) as one spelling per address, or
    ValueError: an IP address in its canonical form, else a name of ``_NAME_CHARS`` with no
    empty label and without the one trailing dot the DNS root allows."""
    if ":" not in host:  # an IPv6 literal keeps its colons; a name drops the root's dot
        host = host[:-1] if host.endswith(".") else host
        if not host or not set(host) <= _NAME_CHARS or "" in host.split("."):
            raise ValueError(f"not a worker URL: host {host!r} (letters, digits, '-', '_' "
                             "and dots, no empty label)")
    if host == "localhost":
        return "127.0.0.1"
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(host)
    except ValueError:
        numeric = inet_aton(host)
        if numeric is None:
            return host  # a name (already lower case)
        address = numeric
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    if address.is_unspecified:
        raise ValueError(f"not a worker URL: {host!r} is the unspecified address (a listening "
                         "socket's wildcard, not an address to send requests to)")
    return f"[{address.compressed}]" if address.version == 6 else str(address)


def inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address ``host`` spells in any form the C library's ``inet_aton`` (and so the OS
    resolver) accepts, else None: one to four dot-separated parts, each decimal, ``0x`` hex or
    ``0`` octal, the last one filling the remaining bytes (``127.1``, ``0x7f000001``,
    ``2130706433``, ``017700000001``, ``0x7f.0.0.1``)."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        lowered = part.lower()
        if lowered.startswith("0x"):
            digits, base = lowered[2:], 16
            valid = bool(digits) and all(c in "0123456789abcdef" for c in digits)
        elif len(part) > 1 and part.startswith("0"):
            digits, base = part[1:], 8
            valid = all(c in "01234567" for c in digits)
        else:
            digits, base = part, 10
            valid = digits.isascii() and digits.isdigit()
        if not valid:
            return None
        values.append(int(digits, base) if digits else 0)  # "0" has no octal digits
    *head, last = values
    if any(v > 255 for v in head) or last >= 1 << (8 * (5 - len(values))):
        return None
    number = last
    for i, value in enumerate(head):
        number |= value << (24 - 8 * i)
    return ipaddress.IPv4Address(number)


class WorkerPool:
    """All workers by URL, with cached per-role lists (the hot path only reads them)."""

    def __init__(self, workers: Iterable[Worker] = ()) -> None:
        self._workers: dict[str, Worker] = {}
        self._by_role: dict[Role, list[Worker]] = {role: [] for role in Role}
        for worker in workers:
            self.add(worker)

    def add(self, worker: Worker) -> None:
        if worker.url in self._workers:
            raise ValueError(f"worker already registered: {worker.url}")
        self._workers[worker.url] = worker
        self._by_role[worker.role] = [*self._by_role[worker.role], worker]

    def remove(self, url: str) -> Worker:
        worker = self._workers.pop(normalize_url(url))
        self._by_role[worker.role] = [w for w in self._by_role[worker.role] if w is not worker]
        return worker

    def get(self, url: str) -> Worker | None:
        try:
            return self._workers.get(normalize_url(url))
        except ValueError:
            return None

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def role(self, role: Role) -> list[Worker]:
        return self._by_role[role]

    def candidates(self, role: Role, now: float, exclude: Iterable[Worker] = ()) -> list[Worker]:
        excluded = set(map(id, exclude))
        return [w for w in self._by_role[role] if id(w) not in excluded and w.available(now)]
