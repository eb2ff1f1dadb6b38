"""The emulated scheduler: SGLang's continuous batching driven by a cost model instead of a GPU.

One asyncio task runs the loop an SGLang scheduler runs:

1. If a prefill batch can be formed, run it (prefill has priority; running decodes wait a pass).
   A batch takes the unfinished chunk of a chunked request first, then waiting requests in FCFS
   order while the chunked-prefill token budget lasts; the last one admitted may be cut into a
   chunk. A request is admitted only when the KV pool (after evicting unlocked cache) can hold
   its uncached prompt plus ``new_token_ratio`` of its remaining output, on top of what the
   running requests have reserved (SGLang's admission rule).
2. Otherwise run one decode step for every running request; when the pool is full, the newest
   request is retracted (its KV freed, its prompt and output re-prefilled later).
3. Each pass sleeps its cost-model time times ``time_scale``; ``model_time`` accumulates the
   unscaled time, so tests can check the schedule without waiting.

The KV pool holds the radix cache's tokens plus each running request's private tokens (the part
not yet inserted into the cache). Prompts are inserted into the cache when their prefill
completes, whole sequences when the request finishes.

PD: in ``prefill`` mode a request stops after its first token and its KV stays held until the
paired decode worker has pulled it (``kv_ready``/``kv_fetched``); in ``decode`` mode a request
arrives with its prefill done elsewhere (``submit_transferred``), waits for KV room, spends the
transfer time, then emits the prefill's first token and joins the decode batch.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable

from omniinfer.emulator.base import PrefillItem
from omniinfer.emulator.profile import Profile
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.emulator.tokenizer import EmulatedTokenizer

MODES = ("null", "prefill", "decode")


@dataclasses.dataclass(eq=False)
class EmuRequest:
    """One generation request and everything the scheduler tracks about it."""

    input_ids: list[int]
    max_new_tokens: int
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    bootstrap_room: int | None = None
    # filled by the engine
    output_ids: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0
    num_retractions: int = 0
    finish_reason: dict[str, object] | None = None
    error: str | None = None
    received_ts: float = 0.0  # wall clock (time.time)
    forward_entry_ts: float | None = None
    first_token_ts: float | None = None
    finished_ts: float | None = None
    model_arrival: float = 0.0  # engine model clock
    model_first_token: float | None = None
    model_finished: float | None = None
    transfer_s: float = 0.0  # decode mode: KV transfer time (model seconds)
    first_token: int | None = None  # decode mode: the token the prefill produced
    # scheduler state
    _fill_ids: list[int] = dataclasses.field(default_factory=list)  # what prefill must cover
    _prefilled: int = 0
    _private: int = 0  # KV tokens held outside the radix cache
    _node: object = None  # locked radix node
    _seed: int = 0
    _last_ts: float = 0.0
    _event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    async def wait_progress(self) -> None:
        await self._event.wait()
        self._event.clear()


@dataclasses.dataclass
class _HeldKV:
    """Prefill mode: the KV of a finished prefill waiting for its decode worker to pull it."""

    request: EmuRequest
    released: bool = False


class Histogram:
    """A Prometheus histogram with fixed buckets (cheap observe)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 120.0, 160.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
               120.0, 160.0, 200.0, 300.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)


@dataclasses.dataclass
class EngineStats:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_total: int = 0
    num_retractions_total: int = 0
    prefill_passes: int = 0
    decode_steps: int = 0
    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = dataclasses.field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = dataclasses.field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = dataclasses.field(default_factory=lambda: Histogram(E2E_BUCKETS))


class EmulatedEngine:
    """Continuous batching, radix prefix cache and KV admission of one emulated worker."""

    def __init__(
        self,
        profile: Profile,
        mode: str = "null",
        time_scale: float = 1.0,
        tokenizer: EmulatedTokenizer | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.profile = profile
        self.mode = mode
        self.time_scale = time_scale
        self.cost = profile.cost_model()
        self.tokenizer = tokenizer or EmulatedTokenizer(profile.model.vocab_size)
        self.clock = clock
        cap = profile.capacity
        self.capacity = cap.max_total_tokens
        use_cache = cap.decode_radix_cache if mode == "decode" else cap.radix_cache
        self.tree: RadixCache | None = RadixCache() if use_cache else None
        self.waiting: collections.deque[EmuRequest] = collections.deque()
        self.running: list[EmuRequest] = []
        self.chunked: EmuRequest | None = None  # admitted, prefill not finished
        self.transferring: set[EmuRequest] = set()  # decode mode: KV arriving
        self.held: dict[int, _HeldKV] = {}  # prefill mode: room -> KV awaiting pull
        self.room_waiters: dict[int, asyncio.Future[EmuRequest]] = {}
        self.private_tokens = 0
        self.model_time = 0.0
        self.stats = EngineStats()
        self._by_rid: dict[str, EmuRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wall_target = 0.0
        self._gen_window: collections.deque[tuple[float, int]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for task in list(self._tasks):
            task.cancel()

    # -- submission ---------------------------------------------------------------------------
    def submit(self, request: EmuRequest) -> EmuRequest:
        """Queue a request for prefill (null and prefill modes)."""
        if not request.input_ids:
            raise ValueError("the prompt is empty")
        if request.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        limit = self.profile.model.context_length
        if len(request.input_ids) >= limit:
            raise ValueError(
                f"The input ({len(request.input_ids)} tokens) is longer than the model's context "
                f"length ({limit} tokens)."
            )
        if len(request.input_ids) + max(request.max_new_tokens, 1) > self.capacity:
            raise ValueError(
                f"the request needs {len(request.input_ids) + request.max_new_tokens} KV tokens, "
                f"more than this worker's pool ({self.capacity})"
            )
        self._register(request)
        request._fill_ids = list(request.input_ids)
        self.waiting.append(request)
        self._wake.set()
        return request

    def submit_transferred(self, request: EmuRequest) -> EmuRequest:
        """Decode mode: a request whose prefill ran elsewhere; first_token and transfer_s set."""
        if len(request.input_ids) + max(request.max_new_tokens, 1) > self.capacity:
            raise ValueError(f"the request needs more KV than this worker's pool ({self.capacity})")
        self._register(request)
        request._fill_ids = []
        self.waiting.append(request)
        self._wake.set()
        return request

    def _register(self, request: EmuRequest) -> None:
        request.received_ts = request.received_ts or self.clock()
        request.model_arrival = self.model_time
        request._seed = hash(tuple(request.input_ids[:64])) & 0x7FFFFFFF
        self._by_rid[request.rid] = request
        self.stats.num_requests_total += 1

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        targets = list(self._by_rid.values()) if abort_all else [self._by_rid[rid]] if rid in self._by_rid else []
        for request in targets:
            self._finish(request, {"type": "abort", "message": "Abort request " + request.rid})
            self.stats.num_aborted_total += 1
        return len(targets)

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while requests are queued or running."""
        if self.waiting or self.running or self.chunked or self.transferring or self.held:
            return False
        if self.tree is not None:
            self.tree.reset()
        return True

    # -- PD: prefill side ---------------------------------------------------------------------
    async def wait_room(self, room: int, timeout: float) -> EmuRequest | None:
        """Prefill mode: wait until the prefill of ``room`` is done; None on timeout."""
        held = self.held.get(room)
        if held is not None:
            return held.request
        future = self.room_waiters.get(room)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self.room_waiters[room] = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            return None

    def kv_fetched(self, room: int, transfer_s: float) -> None:
        """Prefill mode: the decode worker started pulling ``room``; free it after the transfer."""
        held = self.held.get(room)
        if held is None:
            return
        self._later(transfer_s, lambda: self._release_held(room))

    def _release_held(self, room: int) -> None:
        held = self.held.pop(room, None)
        self.room_waiters.pop(room, None)
        if held is not None and not held.released:
            held.released = True
            self._free(held.request, cache_full_sequence=False)
            self._wake.set()

    # -- memory -------------------------------------------------------------------------------
    def used_tokens(self) -> int:
        return self.private_tokens + (self.tree.total if self.tree else 0)

    def evictable_tokens(self) -> int:
        return self.tree.evictable if self.tree else 0

    def available_tokens(self) -> int:
        """Free now plus what eviction could free."""
        return self.capacity - self.used_tokens() + self.evictable_tokens()

    def _allocate(self, request: EmuRequest, tokens: int) -> bool:
        free = self.capacity - self.used_tokens()
        if free < tokens and self.tree is not None:
            self.tree.evict(tokens - free)
            free = self.capacity - self.used_tokens()
        if free < tokens:
            return False
        request._private += tokens
        self.private_tokens += tokens
        return True

    def _output_reserve(self, request: EmuRequest) -> int:
        if self.mode == "prefill":  # a prefill worker never decodes
            return 0
        remaining = max(request.max_new_tokens - len(request.output_ids), 0)
        return int(remaining * self.profile.capacity.new_token_ratio)

    def _reserved_for_running(self) -> int:
        active = [*self.running, *self.transferring]
        if self.chunked is not None:
            active.append(self.chunked)
        return sum(self._output_reserve(r) for r in active)

    def _free(self, request: EmuRequest, cache_full_sequence: bool) -> None:
        if self.tree is not None and request._prefilled and not request.error:
            ids = request.input_ids
            if cache_full_sequence:  # the last token's KV was never computed
                ids = ids + request.output_ids[:-1]
            self.tree.insert(ids)  # adds at most the request's private tokens: the pool cannot grow
        if request._node is not None and self.tree is not None:
            self.tree.unlock(request._node)
            request._node = None
        self.private_tokens -= request._private
        request._private = 0

    # -- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._schedule_prefill()
            if batch:
                duration = self.cost.prefill_time([item for _, item in batch], running=len(self.running))
                await self._pass(loop, duration)
                self.stats.prefill_passes += 1
                self.stats.prefill_busy_s += duration
                self._after_prefill(batch)
            elif self.running:
                kv = sum(len(r.input_ids) + len(r.output_ids) for r in self.running)
                duration = self.cost.decode_time(len(self.running), kv)
                await self._pass(loop, duration)
                self.stats.decode_steps += 1
                self.stats.decode_busy_s += duration
                self._after_decode()
            else:
                self._wake.clear()
                await self._wake.wait()
                self._wall_target = 0.0

    async def _pass(self, loop: asyncio.AbstractEventLoop, duration: float) -> None:
        """Sleep one pass on a virtual schedule, so event-loop lag does not accumulate."""
        self.model_time += duration
        now = loop.time()
        if self._wall_target < now - 0.25:  # idle before, or hopelessly behind: restart the schedule
            self._wall_target = now
        self._wall_target += duration * self.time_scale
        await asyncio.sleep(max(self._wall_target - now, 0.0))

    def _schedule_prefill(self) -> list[tuple[EmuRequest, PrefillItem]]:
        cap = self.profile.capacity
        budget = cap.chunked_prefill_size
        batch: list[tuple[EmuRequest, PrefillItem]] = []
        if self.chunked is not None:
            request = self.chunked
            chunk = min(len(request._fill_ids) - request._prefilled, budget)
            batch.append((request, PrefillItem(chunk, request._prefilled)))
            budget -= chunk
            if request._prefilled + chunk < len(request._fill_ids):
                return batch
            self.chunked = None
        admitted_tokens = 0
        while self.waiting and budget > 0:
            if len(self.running) + len(self.transferring) + len(batch) >= cap.max_running_requests:
                break
            request = self.waiting[0]
            if self.mode == "decode" and not request._fill_ids:
                if not self._admit_transferred(request):
                    break
                self.waiting.popleft()
                continue
            match_len, node = 0, None
            if self.tree is not None:
                match_len, node = self.tree.match_prefix(request._fill_ids[:-1])
            uncached = len(request._fill_ids) - match_len
            if batch and admitted_tokens + uncached > cap.max_prefill_tokens:
                break
            reserve = self._output_reserve(request)
            if uncached + reserve + self._reserved_for_running() > self.available_tokens():
                break
            if node is not None and self.tree is not None:
                self.tree.lock(node)  # before allocating, so eviction cannot take the prefix
                request._node = node
            if not self._allocate(request, uncached):  # cannot happen after the check above
                if request._node is not None and self.tree is not None:
                    self.tree.unlock(request._node)
                    request._node = None
                break
            self.waiting.popleft()
            if request.forward_entry_ts is None:
                request.forward_entry_ts = self.clock()
                self.stats.queue_time.observe(request.forward_entry_ts - request.received_ts)
                request.cached_tokens = match_len
                self.stats.cached_tokens_total += match_len
                self.stats.prompt_tokens_total += len(request.input_ids)
            request._prefilled = match_len
            chunk = min(uncached, budget)
            batch.append((request, PrefillItem(chunk, match_len)))
            budget -= chunk
            admitted_tokens += uncached
            if chunk < uncached:
                self.chunked = request
                break
        return batch

    def _admit_transferred(self, request: EmuRequest) -> bool:
        """Decode mode: reserve KV for a transferred prompt, then start the transfer."""
        reserve = self._output_reserve(request)
        if len(request.input_ids) + reserve + self._reserved_for_running() > self.available_tokens():
            return False
        if not self._allocate(request, len(request.input_ids)):
            return False
        request.forward_entry_ts = self.clock()
        self.stats.queue_time.observe(request.forward_entry_ts - request.received_ts)
        self.stats.prompt_tokens_total += len(request.input_ids)
        request._prefilled = len(request.input_ids)
        self.transferring.add(request)
        self._later(request.transfer_s, lambda: self._transfer_done(request))
        return True

    def _transfer_done(self, request: EmuRequest) -> None:
        if request not in self.transferring:
            return  # aborted meanwhile
        self.transferring.discard(request)
        token = request.first_token if request.first_token is not None else self._next_token(request)
        self._emit(request, token)
        if not self._maybe_finish(request):
            self.running.append(request)
        self._wake.set()

    def _after_prefill(self, batch: list[tuple[EmuRequest, PrefillItem]]) -> None:
        for request, item in batch:
            if request.finished:  # aborted during the pass
                continue
            request._prefilled += item.new_tokens
            if request is self.chunked:
                continue
            if self.tree is not None:  # the prompt's KV now lives in the cache, locked
                self.tree.insert(request._fill_ids)
                match_len, node = self.tree.match_prefix(request._fill_ids)
                self.tree.lock(node)
                if request._node is not None:
                    self.tree.unlock(request._node)
                request._node = node
                moved = min(request._private, len(request._fill_ids))
                request._private -= moved
                self.private_tokens -= moved
            if request.num_retractions and request.output_ids:
                self.running.append(request)  # resumed after retraction: no new token
                continue
            if request.max_new_tokens == 0 and self.mode != "prefill":
                self._finish(request, {"type": "length", "length": 0})
                continue
            self._emit(request, self._next_token(request))
            if self.mode == "prefill":
                self._finish_prefill(request)
            elif not self._maybe_finish(request):
                self.running.append(request)

    def _finish_prefill(self, request: EmuRequest) -> None:
        """Prefill mode: the request is done here; its KV waits for the decode worker."""
        request.finish_reason = {"type": "length", "length": len(request.output_ids)}
        self._mark_finished(request)
        room = request.bootstrap_room
        if room is None:
            self._free(request, cache_full_sequence=False)
            return
        self.held[room] = _HeldKV(request)
        waiter = self.room_waiters.get(room)
        if waiter is not None and not waiter.done():
            waiter.set_result(request)
        timeout = self.profile.transfer.bootstrap_timeout_s
        self._later(timeout, lambda: self._release_held(room))

    def _after_decode(self) -> None:
        now = self.clock()
        for request in list(self.running):
            if request.finished:
                continue
            if not self._allocate(request, 1) and not self._retract_for(request):
                continue
            if request.finished:
                continue
            self._emit(request, self._next_token(request), now)
            self._maybe_finish(request)
        self.running = [r for r in self.running if not r.finished]

    def _retract_for(self, request: EmuRequest) -> bool:
        """The pool is full: retract the newest other running request (or this one)."""
        while True:
            victims = [r for r in self.running if not r.finished and r is not request]
            if not victims:
                self._retract(request)
                return False
            self._retract(victims[-1])
            if self._allocate(request, 1):
                return True

    def _retract(self, request: EmuRequest) -> None:
        self.running.remove(request)
        self._free(request, cache_full_sequence=False)
        request._fill_ids = request.input_ids + request.output_ids
        request._prefilled = 0
        request.num_retractions += 1
        self.stats.num_retractions_total += 1
        self.waiting.appendleft(request)

    # -- outputs ------------------------------------------------------------------------------
    def _next_token(self, request: EmuRequest) -> int:
        return self.tokenizer.output_token(request._seed, len(request.output_ids))

    def _emit(self, request: EmuRequest, token: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        if request.output_ids:
            self.stats.itl.observe(now - request._last_ts)
        else:
            request.first_token_ts = now
            request.model_first_token = self.model_time
            self.stats.ttft.observe(now - request.received_ts)
        request._last_ts = now
        request.output_ids.append(token)
        self.stats.generation_tokens_total += 1
        self._gen_window.append((now, 1))
        request._event.set()

    def _maybe_finish(self, request: EmuRequest) -> bool:
        if len(request.output_ids) >= max(request.max_new_tokens, 1):
            self._finish(request, {"type": "length", "length": len(request.output_ids)})
            return True
        return False

    def _mark_finished(self, request: EmuRequest) -> None:
        request.finished_ts = self.clock()
        request.model_finished = self.model_time
        self.stats.e2e.observe(request.finished_ts - request.received_ts)
        self._by_rid.pop(request.rid, None)
        request._event.set()

    def _finish(self, request: EmuRequest, reason: dict[str, object]) -> None:
        if request.finished:
            return
        request.finish_reason = reason
        was_admitted = request._private or request._node is not None
        if request in self.waiting:
            self.waiting.remove(request)
        if request is self.chunked:
            self.chunked = None
        self.transferring.discard(request)
        if request in self.running:
            self.running.remove(request)
        if was_admitted:
            self._free(request, cache_full_sequence=reason.get("type") == "length")
        self._mark_finished(request)
        self._wake.set()

    def fail(self, request: EmuRequest, message: str) -> None:
        request.error = message
        self._finish(request, {"type": "abort", "message": message})

    def _later(self, model_seconds: float, callback: Callable[[], None]) -> None:
        async def run() -> None:
            await asyncio.sleep(model_seconds * self.time_scale)
            callback()

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- load figures -------------------------------------------------------------------------
    def gen_throughput(self, window_s: float = 5.0) -> float:
        now = self.clock()
        while self._gen_window and self._gen_window[0][0] < now - window_s:
            self._gen_window.popleft()
        return sum(n for _, n in self._gen_window) / window_s

    def cache_hit_rate(self) -> float:
        total = self.stats.prompt_tokens_total
        return self.stats.cached_tokens_total / total if total else 0.0

    def waiting_uncached_tokens(self) -> int:
        return sum(len(r._fill_ids) for r in self.waiting)
