"""One emulated generation request: what the client asked for and what the scheduler tracks."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid


@dataclasses.dataclass(eq=False)
class EmuRequest:
    """One generation request and everything the scheduler tracks about it."""

    input_ids: list[int]
    max_new_tokens: int
    rid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    bootstrap_room: int | None = None
    stream: bool = False  # the client streams (SGLang's is_streaming metric label)
    # The hang fault: the request stops making progress once it has this many output tokens
    # (0: it is never scheduled) and ends only when aborted. -1: off.
    stall_after_tokens: int = -1
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
    model_first_token: float | None = None  # engine model clock
    model_finished: float | None = None
    transfer_s: float = 0.0  # decode mode: KV transfer time (model seconds)
    first_token: int | None = None  # decode mode: the token the prefill produced
    # scheduler state
    _fill_ids: list[int] = dataclasses.field(default_factory=list)  # what prefill must cover
    _prefilled: int = 0
    _private: int = 0  # KV tokens held outside the radix cache
    _kv_len: int = 0  # KV tokens the request holds in all (cached prefix + private)
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

    @property
    def stalled(self) -> bool:
        """The hang fault holds it: no more tokens until it is aborted."""
        return 0 <= self.stall_after_tokens <= len(self.output_ids)

    async def wait_progress(self) -> None:
        await self._event.wait()
        self._event.clear()


@dataclasses.dataclass
class HeldKV:
    """Prefill mode: the KV of a finished prefill waiting for its decode worker to pull it."""

    request: EmuRequest
    released: bool = False
