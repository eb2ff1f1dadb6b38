"""An SGLang-protocol worker emulator: SGLang 0.5.23's HTTP surface over a calibrated cost model.

``profile`` loads YAML profiles into the cost model the engine asks (``interfaces``); ``engine``
schedules (continuous batching, chunked prefill, PD) over ``kv_pool`` (KV accounting and
admission) and ``radix_cache`` (the prefix cache); ``sparse`` models the MoE placement and
attention-pattern terms; ``kv_event_publisher`` and ``load_publisher`` publish SGLang's two ZMQ
feeds; ``server`` speaks HTTP with ``status``, ``metrics`` and ``pd`` beside it; ``faults`` holds
the fault switches; ``process`` runs one as a child process; ``cli`` adds
``omniinfer emulate-worker``.
"""
