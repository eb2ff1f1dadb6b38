"""The emulated scheduler: SGLang's continuous batching driven by a cost model instead of a GPU.

One asyncio task runs the loop an SGLang scheduler runs:

1. If a prefill batch can be formed, run it (prefill has priority; running decodes wait a pass).
   A batch takes the unfinished chunk of a chunked request first, then waiting requests in FCFS
   order while the chunked-prefill token budget lasts; the last one admitted may be cut into a
   chunk. Admission is the KV pool's rule (``kv_pool.py``).
2. Otherwise run one decode step for every running request; when the pool is full, the newest
   request is retracted (its KV freed, its prompt and output re-prefilled later).
3. Each pass sleeps its cost-model time times ``time_scale``; ``model_time`` accumulates the
   unscaled time, so tests can check the schedule without waiting. With the profile's MoE term
   on, every pass asks the MoE clock (``sparse.MoeClock``) for its factor and any EPLB stall:
   ``duration = stall + factor · cost``; an attention pattern shrinks the KV each request
   holds and reads (``kv_pool.py``, ``sparse.AttnPattern``).

PD: in ``prefill`` mode a request stops after its first token and its KV stays held until the
paired decode worker has pulled it (``wait_room``/``kv_fetched``); in ``decode`` mode a request
is registered while it waits for its prefill elsewhere (``begin_bootstrap``), then arrives with
that prefill done (``submit_transferred``), waits for KV room, spends the transfer time, emits
the prefill's first token and joins the decode batch.

The hang fault (``EmuRequest.stall_after_tokens``) parks a request: at arrival it is never
scheduled; mid-generation it keeps its KV and makes no progress. Either way only an abort ends it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable

from omniinfer.emulator.interfaces import PrefillItem
from omniinfer.emulator.kv_pool import KVPool
from omniinfer.emulator.profile import Profile
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.emulator.request import EmuRequest, HeldKV
from omniinfer.emulator.sparse import MoeClock
from omniinfer.emulator.stats import EngineStats
from omniinfer.emulator.tokenizer import EmulatedTokenizer

MODES = ("null", "prefill", "decode")


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
        use_cache = cap.decode_radix_cache if mode == "decode" else cap.radix_cache
        self.kv = KVPool(cap.max_total_tokens, RadixCache() if use_cache else None,
                         cap.new_token_ratio, reserve_output=mode != "prefill", pattern=profile.attn_pattern)
        self.moe = MoeClock(profile.moe) if profile.moe.active else None
        self.waiting: collections.deque[EmuRequest] = collections.deque()
        self.running: list[EmuRequest] = []
        self.chunked: EmuRequest | None = None  # admitted, prefill not finished
        self.transferring: set[EmuRequest] = set()  # decode mode: KV arriving
        self.bootstrapping: set[EmuRequest] = set()  # decode mode: waiting for the prefill
        self.parked: set[EmuRequest] = set()  # hang fault at arrival: never scheduled
        self.stalled: set[EmuRequest] = set()  # hang fault mid-generation: KV held, no progress
        self.held: dict[int, HeldKV] = {}  # prefill mode: room -> KV awaiting pull
        self.room_waiters: dict[int, asyncio.Future[EmuRequest]] = {}
        self.model_time = 0.0
        self.stats = EngineStats()
        self._by_rid: dict[str, EmuRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wall_target = 0.0
        self._gen_window: collections.deque[tuple[float, int]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = itertools.count()
        self.passing = False  # inside a prefill or decode pass (the load feed waits for its end)
        self.on_pass: Callable[[str], None] | None = None  # after each pass: "prefill" | "decode"

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
        self._check_fits(request)
        self._register(request)
        request._fill_ids = list(request.input_ids)
        self._enqueue(request)
        return request

    def begin_bootstrap(self, request: EmuRequest) -> EmuRequest:
        """Decode mode: register a request whose prefill runs elsewhere (abortable meanwhile)."""
        self._check_fits(request)
        self._register(request)
        self.bootstrapping.add(request)
        return request

    def submit_transferred(self, request: EmuRequest) -> EmuRequest:
        """Decode mode: the prefill is done elsewhere; ``first_token`` and ``transfer_s`` are set."""
        if request in self.bootstrapping:
            self.bootstrapping.discard(request)
        else:
            self._check_fits(request)
            self._register(request)
        request._fill_ids = []
        self._enqueue(request)
        return request

    def _check_fits(self, request: EmuRequest) -> None:
        need = len(request.input_ids) + max(request.max_new_tokens, 1)
        if self.kv.footprint(need) > self.kv.capacity:
            raise ValueError(f"the request needs {need} KV tokens, more than this worker's pool "
                             f"({self.kv.capacity})")

    def _register(self, request: EmuRequest) -> None:
        request.received_ts = request.received_ts or self.clock()
        request._seed = hash(tuple(request.input_ids[:64])) & 0x7FFFFFFF
        self._by_rid[request.rid] = request
        self.stats.num_requests_total += 1

    def _enqueue(self, request: EmuRequest) -> None:
        if request.stalled:  # the hang fault at arrival
            self.parked.add(request)
            return
        self.waiting.append(request)
        self._wake.set()

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's rule: a known ``rid`` aborts every request whose rid starts with it."""
        if abort_all:
            targets = list(self._by_rid.values())
        elif rid and rid in self._by_rid:
            targets = [r for key, r in self._by_rid.items() if key.startswith(rid)]
        else:
            targets = []
        for request in targets:
            self._finish(request, {"type": "abort", "message": "Abort request " + request.rid})
        return len(targets)

    def flush_cache(self) -> bool:
        """Empty the radix cache; refused (False) while any request is held here."""
        if self._by_rid or self.transferring or self.held:
            return False
        self.kv.flush()
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
            self.kv.free(held.request, cache_full_sequence=False)
            self._wake.set()

    # -- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = self._schedule_prefill()
            if batch:
                duration, stall = self._moe(self.cost.prefill_time([i for _, i in batch], len(self.running)))
                await self._pass(loop, stall + duration)
                self.stats.prefill_passes += 1
                self.stats.prefill_busy_s += duration
                self._after_prefill(batch)
                if self.on_pass is not None:
                    self.on_pass("prefill")
            elif self.running:
                kv = sum(self.kv.footprint(len(r.input_ids) + len(r.output_ids)) for r in self.running)
                duration, stall = self._moe(self.cost.decode_time(len(self.running), kv))
                await self._pass(loop, stall + duration)
                self.stats.decode_steps += 1
                self.stats.decode_busy_s += duration
                self._after_decode()
                if self.on_pass is not None:
                    self.on_pass("decode")
            else:
                self._wake.clear()
                await self._wake.wait()
                self._wall_target = 0.0

    def _moe(self, duration: float) -> tuple[float, float]:
        """A pass's cost-model time under the MoE term, and the stall before it (model s)."""
        if self.moe is None:
            return duration, 0.0
        step = self.moe.step(self.model_time)
        return duration * step.factor, step.stall_s

    async def _pass(self, loop: asyncio.AbstractEventLoop, duration: float) -> None:
        """Sleep one pass on a virtual schedule, so event-loop lag does not accumulate."""
        self.model_time += duration
        now = loop.time()
        if self._wall_target < now - 0.25:  # idle before, or hopelessly behind: restart the schedule
            self._wall_target = now
        self._wall_target += duration * self.time_scale
        self.passing = True
        try:
            await asyncio.sleep(max(self._wall_target - now, 0.0))
        finally:
            self.passing = False

    def _admitted(self) -> list[EmuRequest]:
        """Requests holding KV and a running slot (their output reserve counts at admission)."""
        active = [*self.running, *self.transferring, *self.stalled]
        if self.chunked is not None:
            active.append(self.chunked)
        return active

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
            if len(self.running) + len(self.transferring) + len(self.stalled) + len(batch) >= cap.max_running_requests:
                break
            request = self.waiting[0]
            if self.mode == "decode" and not request._fill_ids:
                if not self._admit_transferred(request):
                    break
                self.waiting.popleft()
                continue
            match_len, node = self.kv.match(request._fill_ids[:-1])
            uncached = len(request._fill_ids) - match_len
            if batch and admitted_tokens + uncached > cap.max_prefill_tokens:
                break
            need = self.kv.admission_need(request, uncached, match_len)
            if need + self.kv.reserved_for(self._admitted()) > self.kv.available():
                break
            self.kv.lock(request, node)  # before allocating, so eviction cannot take the prefix
            if not self.kv.allocate(request, uncached, match_len):  # cannot happen after the check
                self.kv.unlock(request)
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
        need = self.kv.admission_need(request, len(request.input_ids), 0)
        if need + self.kv.reserved_for(self._admitted()) > self.kv.available():
            return False
        if not self.kv.allocate(request, len(request.input_ids)):
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
        if self._keeps_running(request):
            self.running.append(request)
        self._wake.set()

    def _after_prefill(self, batch: list[tuple[EmuRequest, PrefillItem]]) -> None:
        for request, item in batch:
            if request.finished:  # aborted during the pass
                continue
            request._prefilled += item.new_tokens
            if request is self.chunked:
                continue
            self.kv.cache_prompt(request)  # the prompt's KV now lives in the cache, locked
            if request.num_retractions and request.output_ids:
                self.running.append(request)  # resumed after retraction: no new token
                continue
            if request.max_new_tokens == 0 and self.mode != "prefill":
                self._finish(request, {"type": "length", "length": 0})
                continue
            self._emit(request, self._next_token(request))
            if self.mode == "prefill":
                self._finish_prefill(request)
            elif self._keeps_running(request):
                self.running.append(request)

    def _finish_prefill(self, request: EmuRequest) -> None:
        """Prefill mode: the request is done here; its KV waits for the decode worker."""
        request.finish_reason = {"type": "length", "length": len(request.output_ids)}
        self._mark_finished(request)
        room = request.bootstrap_room
        if room is None:
            self.kv.free(request, cache_full_sequence=False)
            return
        self.held[room] = HeldKV(request)
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
            if not self.kv.allocate(request, 1) and not self._retract_for(request):
                continue
            if request.finished:
                continue
            self._emit(request, self._next_token(request), now)
            self._keeps_running(request)
        self.running = [r for r in self.running if not r.finished and r not in self.stalled]

    def _keeps_running(self, request: EmuRequest) -> bool:
        """After a token: finished at its length, stalled by the hang fault, or still running."""
        if len(request.output_ids) >= max(request.max_new_tokens, 1):
            self._finish(request, {"type": "length", "length": len(request.output_ids)})
            return False
        if request.stalled:
            self.stalled.add(request)
            return False
        return True

    def _retract_for(self, request: EmuRequest) -> bool:
        """The pool is full: retract the newest other running request (or this one)."""
        while True:
            victims = [r for r in self.running if not r.finished and r is not request]
            if not victims:
                self._retract(request)
                return False
            self._retract(victims[-1])
            if self.kv.allocate(request, 1):
                return True

    def _retract(self, request: EmuRequest) -> None:
        self.running.remove(request)
        self.kv.free(request, cache_full_sequence=False)
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
            self.stats.observe_ttft(request, now - request.received_ts)
        request._last_ts = now
        request.output_ids.append(token)
        self.stats.generation_tokens_total += 1
        self._gen_window.append((now, 1))
        request._event.set()

    def _mark_finished(self, request: EmuRequest) -> None:
        request.finished_ts = self.clock()
        request.model_finished = self.model_time
        self.stats.observe_finished(request, request.finished_ts - request.received_ts)
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
        for group in (self.transferring, self.bootstrapping, self.parked, self.stalled):
            group.discard(request)
        if request in self.running:
            self.running.remove(request)
        if was_admitted:
            self.kv.free(request, cache_full_sequence=reason.get("type") == "length")
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
    def num_running(self) -> int:
        """Running as SGLang counts them: decoding, mid-chunk, and stalled by the hang fault."""
        return len(self.running) + len(self.stalled) + (1 if self.chunked else 0)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.parked)

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
