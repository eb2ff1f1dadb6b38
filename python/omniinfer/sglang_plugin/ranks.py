"""This scheduler's place in SGLang's parallel layout (the one rank helper of the plugin)."""

from __future__ import annotations


def tp_rank() -> int | None:
    """This scheduler's tensor-parallel rank, from SGLang's runtime context (None outside a
    scheduler, where the context is not published)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:  # noqa: BLE001 - any failure means: not inside a scheduler
        return None
