"""An SGLang-protocol worker emulator: SGLang 0.5.23's HTTP surface over a calibrated cost model.

``profile`` loads YAML profiles; ``engine`` schedules (continuous batching, chunked prefill, PD)
over ``kv_pool`` (radix prefix cache, KV admission); ``server`` speaks HTTP with ``status``,
``metrics`` and ``pd`` beside it; ``faults`` holds the fault switches; ``process`` runs one as a
child process; ``cli`` adds ``omniinfer emulate-worker``.
"""
