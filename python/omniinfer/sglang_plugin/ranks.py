"""This scheduler's place in SGLang's parallel layout (the one rank helper of the plugin)."""

from __future__ import annotations


def tp_rank() -> int | None:
    """This process's tensor-parallel rank, from SGLang's runtime context.

    None only in the one expected case: the rank has not been written in this process (outside
    a scheduler, or before SGLang publishes it), where SGLang's ``ParallelContext`` raises
    ``RuntimeError`` on the read. Anything else propagates: an ``ImportError`` or
    ``AttributeError`` (``get_parallel`` or ``tp_rank`` renamed; ``get_parallel`` is a declared
    internal, checked at scheduler start), a ``TypeError``/``ValueError`` from a rank that is no
    integer.
    """
    from sglang.srt.runtime_context import get_parallel

    context = get_parallel()
    try:
        rank = context.tp_rank
    except RuntimeError:  # "parallel name 'tp_rank' has not been written in this process"
        return None
    return int(rank)
