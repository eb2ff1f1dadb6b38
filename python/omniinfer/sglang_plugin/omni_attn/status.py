"""OmniAttn status: pool sizes, live usage and freed slots, for ``GET /omni/attn`` and logs.

Scheduler rank 0 writes ``attn.json`` under ``$OMNIINFER_STATE_DIR`` (atomically, at most twice
a second from the decode loop); the HTTP server in the launcher process only reads it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniinfer.attn.pattern import Pattern
from omniinfer.sglang_plugin.http_routes import STATE_DIR_ENV

STATUS_FILE = "attn.json"
WRITE_PERIOD_S = 0.5


def _pool_bytes(pool: Any) -> int:
    k, v = pool.get_kv_size_bytes() if hasattr(pool, "get_kv_size_bytes") else (0, 0)
    return int(k) + int(v)


@dataclass(eq=False)
class AttnStatus:
    """Counters and pool facts of one scheduler; ``write`` publishes them as JSON."""

    pattern: Pattern
    allocator: Any
    kvcache: Any
    attention: Any
    max_total_tokens: int | None
    writer: bool
    tree_cache: Any = None
    tokens_freed: int = 0  # compressed-layer slots returned before their request ended
    freed_events: int = 0
    _last_write: float = field(default=0.0, repr=False)

    @classmethod
    def from_scheduler(cls, scheduler: Any, pattern: Pattern, attention: Any,
                       writer: bool) -> AttnStatus:
        """The status of ``scheduler`` (its ``server_args``, ``tree_cache`` and the
        ``max_total_tokens`` field are declared internals, checked at start-up)."""
        allocator = scheduler.token_to_kv_pool_allocator
        return cls(pattern, allocator, allocator.get_kvcache(), attention,
                   scheduler.server_args.max_total_tokens, writer, scheduler.tree_cache)

    def on_freed(self, slots: int) -> None:
        self.tokens_freed += slots
        self.freed_events += 1

    def pools(self) -> dict[str, Any]:
        full_pool = getattr(self.kvcache, "full_kv_pool", None)
        swa_pool = getattr(self.kvcache, "swa_kv_pool", None)
        full_bytes, swa_bytes = _pool_bytes(full_pool), _pool_bytes(swa_pool)
        full_layers = self.pattern.num_layers - len(self.pattern.compressed_layers)
        full_tokens = int(self.allocator.size_full)
        per_layer_token = full_bytes / max(1, full_layers * full_tokens)
        baseline = (
            int(self.max_total_tokens * self.pattern.num_layers * per_layer_token)
            if self.max_total_tokens else None
        )
        return {
            "full": {"layers": full_layers, "tokens": full_tokens, "bytes": full_bytes},
            "compressed": {
                "layers": len(self.pattern.compressed_layers),
                "tokens": int(self.allocator.size_swa),
                "bytes": swa_bytes,
            },
            "max_total_tokens": self.max_total_tokens,
            "uncompressed_bytes_for_max_total_tokens": baseline,
        }

    def snapshot(self) -> dict[str, Any]:
        attention = self.attention
        return {
            "enabled": True,
            "pattern": {
                "model": self.pattern.model_id,
                "sink": self.pattern.sink,
                "recent": self.pattern.recent,
                "compressed_layers": list(self.pattern.compressed_layers),
                "num_layers": self.pattern.num_layers,
            },
            "pools": self.pools(),
            "usage": {
                "full_tokens_free": int(self.allocator.full_available_size()),
                "compressed_tokens_free": int(self.allocator.swa_available_size()),
                "compressed_tokens_used": int(self.allocator.size_swa)
                - int(self.allocator.swa_available_size()),
            },
            "tokens_freed": self.tokens_freed,
            "free_events": self.freed_events,
            "compressed_keys_read": getattr(attention, "keys_read", 0),
            "compressed_keys_full_attention": getattr(attention, "keys_full", 0),
            "radix": self._radix(),
            "pd_transfer": self._transfer(),
            "updated": time.time(),
        }

    def _transfer(self) -> dict[str, Any] | None:
        """What a prefill server sent to decode servers (None unless it is one)."""
        from omniinfer.sglang_plugin.omni_attn import pd

        meter = pd.meter()
        return meter.describe() if meter.requests or meter.tokens else None

    def _radix(self) -> dict[str, Any] | None:
        """The prefix cache: which classes run, its ledger and what the sink rules did."""
        if self.tree_cache is None:
            return None
        from omniinfer.sglang_plugin.omni_attn import radix

        return radix.describe(self.tree_cache)

    def write(self) -> None:
        if not self.writer:
            return
        directory = os.environ.get(STATE_DIR_ENV)
        if not directory:
            return
        path = Path(directory) / STATUS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        tmp.replace(path)
        self._last_write = time.monotonic()

    def maybe_write(self) -> None:
        if time.monotonic() - self._last_write >= WRITE_PERIOD_S:
            self.write()
