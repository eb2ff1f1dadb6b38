"""An SGLang-protocol worker emulator: SGLang 0.5.23's HTTP surface over a calibrated cost model.

``profile`` loads YAML profiles, ``engine`` schedules (continuous batching, chunked prefill, radix
prefix cache, KV admission, PD), ``server`` speaks HTTP, ``cli`` adds ``omniinfer emulate-worker``.
"""
