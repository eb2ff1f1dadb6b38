"""The thin adapter between OmniInfer and SGLang.

SGLang calls :func:`load` (entry point group ``sglang.srt.plugins``) early in every process it
starts: the launcher, each scheduler, the detokenizer and the DP controller. Everything here
talks to SGLang only through HookRegistry targets named in this package (checked by
:mod:`.hooks`) and the private names declared in :mod:`.internals`, so when SGLang moves, only
this package moves.

Layout: shared glue at the top (:mod:`.hooks`, :mod:`.internals`, :mod:`.server_args`,
:mod:`.http_routes`, :mod:`.cpu_fixes`, :mod:`.worker`, :mod:`.ranks`), one sub-package per
technique (:mod:`.omni_attn`, :mod:`.placement`).
"""

from __future__ import annotations

import sys

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def in_scheduler_process() -> bool:
    """Scheduler processes import the scheduler module before they load plugins; others don't.

    Worker-side hooks are registered only there, so the launcher (and ``--help``) does not
    import the model runtime just to patch it.
    """
    return SCHEDULER_MODULE in sys.modules


def load() -> None:
    """Register the omni hooks in the current SGLang process."""
    from omniinfer.cpu.detect import cpu_engine_active
    from omniinfer.sglang_plugin import server_args
    from omniinfer.sglang_plugin.omni_attn import triton_backend

    server_args.register()
    # --attention-backend omni_triton: a choice everywhere, a factory where models run.
    triton_backend.register_backend(with_factory=in_scheduler_process())
    if in_scheduler_process():
        from omniinfer.sglang_plugin import worker

        worker.register()
        if cpu_engine_active():
            from omniinfer.sglang_plugin import cpu_fixes

            cpu_fixes.register()
