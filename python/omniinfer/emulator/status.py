"""The status bodies of an emulated worker: /model_info, /v1/models, /server_info, /v1/loads.

Pure functions of the worker's identity and its engine's state, in SGLang 0.5.23's shapes
(the capture in ``test/emulator/sglang_0.5.23_capture.json`` is what the tests compare with).
/server_info also carries the emulator's own ``emulator_sparse`` block (:func:`sparse`), which
``GET /emulator/sparse`` serves alone.
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources
from typing import Any

from omniinfer.emulator.engine import EmulatedEngine
from omniinfer.emulator.kv_event_publisher import server_info_block
from omniinfer.emulator.profile import Profile
from omniinfer.kv_event_wire import KvEventsConfig
from omniinfer.load_feed_wire import LOAD_TOPIC, LoadStat

LOADS_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """What a worker says about itself (fixed at start)."""

    profile: Profile
    mode: str
    host: str
    port: int
    bootstrap_port: int
    time_scale: float
    kv_events_raw: str | None = None
    kv_events: KvEventsConfig | None = None
    load_publish_raw: str | None = None  # --load-publish-endpoint as given
    load_endpoint: tuple[str, int] | None = None  # resolved (bind host, port); None: off
    start_ts: float = dataclasses.field(default_factory=time.time)

    @property
    def engine_type(self) -> str:
        """SGLang's ``engine_type`` metric label."""
        return "unified" if self.mode == "null" else self.mode


def model_info(info: WorkerInfo) -> dict[str, Any]:
    m = info.profile.model
    return {
        "model_path": m.model_path, "served_model_name": m.served_model_name,
        "tokenizer_path": m.model_path, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
        "tool_call_parser": None, "disaggregation_mode": info.mode,
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": m.model_type, "architectures": list(m.architectures),
    }


def models(info: WorkerInfo) -> dict[str, Any]:
    m = info.profile.model
    return {"object": "list", "data": [{
        "id": m.served_model_name, "object": "model", "created": int(info.start_ts),
        "owned_by": "sglang", "root": m.model_path, "parent": None, "max_model_len": m.context_length,
    }]}


def _server_args(info: WorkerInfo) -> dict[str, Any]:
    template = json.loads(
        resources.files("omniinfer.emulator").joinpath("sglang_0.5.23_server_info.json").read_text("utf-8")
    )
    cap, m = info.profile.capacity, info.profile.model
    template.update({
        "model_path": m.model_path, "tokenizer_path": m.model_path, "served_model_name": m.served_model_name,
        "host": info.host, "port": info.port, "device": "emulated",
        "max_total_tokens": cap.max_total_tokens, "max_total_num_tokens": cap.max_total_tokens,
        "chunked_prefill_size": cap.chunked_prefill_size, "max_prefill_tokens": cap.max_prefill_tokens,
        "max_running_requests": cap.max_running_requests, "context_length": m.context_length,
        "max_req_input_len": m.context_length - 6, "disable_radix_cache": not cap.radix_cache,
        "disaggregation_mode": info.mode, "disaggregation_bootstrap_port": info.bootstrap_port,
        "disaggregation_transfer_backend": "emulated",
        "disaggregation_decode_enable_radix_cache": cap.decode_radix_cache,
        "launch_command": f"omniinfer emulate-worker --profile {info.profile.name} --port {info.port} "
                          f"--disaggregation-mode {info.mode} --time-scale {info.time_scale}",
        "emulated": True, "emulator_profile": info.profile.name, "emulator_time_scale": info.time_scale,
        "kv_events_config": info.kv_events_raw, "kv_events": _kv_events_block(info),
        "load_publish_endpoint": info.load_publish_raw,
    })
    return template


def _kv_events_block(info: WorkerInfo) -> dict[str, Any] | None:
    """SGLang's ``kv_events`` block, with the load feed's port and topic when it publishes one."""
    block = server_info_block(info.kv_events)
    if block is not None and info.load_endpoint is not None:
        block["load_endpoint_port_base"] = info.load_endpoint[1]
        block["load_topic"] = LOAD_TOPIC
    return block


def load_stat(info: WorkerInfo, engine: EmulatedEngine) -> LoadStat:
    """The load feed's reading: the same figures as the ``/v1/loads`` entry."""
    e, kv = engine, engine.kv
    used = kv.used()
    return LoadStat(
        e.num_running(), e.num_waiting(), used, kv.capacity, 0, e.waiting_uncached_tokens(),
        used, info.profile.capacity.max_running_requests,
        e.stats.prompt_tokens_total - e.stats.cached_tokens_total,
        int(e.stats.prefill_busy_s * info.time_scale * 1e6))


def sparse(info: WorkerInfo, engine: EmulatedEngine) -> dict[str, Any]:
    """The MoE and attention-pattern settings with their live figures: the MoE clock's window,
    B, rebalances, experts and bytes moved, stalls; the pattern's compressed-layer tokens held."""
    moe = engine.moe.status() if engine.moe is not None else info.profile.moe.as_dict()
    pattern = {**info.profile.attn_pattern.as_dict(), "window_tokens_held": engine.kv.window_tokens,
               "pool_used": engine.kv.used(), "pool_capacity": engine.kv.capacity}
    return {"moe": moe, "attn_pattern": pattern}


def server_info(info: WorkerInfo, engine: EmulatedEngine) -> dict[str, Any]:
    body = _server_args(info)
    internal = {k: v for k, v in body.items() if k not in ("internal_states", "version", "frontend",
                                                           "launch_command", "status")}
    internal.update({
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "startup_available": 0.0,
                         "token_capacity": engine.kv.capacity, "token_capacity_swa": None,
                         "graph": {}},
        "decode_cuda_graph_bs": [], "decode_cuda_graph_memory_gb": 0.0,
        "effective_max_running_requests_per_dp": info.profile.capacity.max_running_requests,
        "world_size": 1, "last_gen_throughput": engine.gen_throughput(),
    })
    body["internal_states"] = [internal]
    body["emulator_sparse"] = sparse(info, engine)
    body["startup_time"] = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                            "tokenizer_e2e": 0.0}
    body["status"] = "ready"
    body["version"] = "0.5.23"
    body["frontend"] = "python"
    return body


def utilization(info: WorkerInfo, engine: EmulatedEngine) -> float:
    return (engine.num_running() + engine.num_waiting()) / info.profile.capacity.max_running_requests


def load(info: WorkerInfo, engine: EmulatedEngine) -> dict[str, Any]:
    """One DP rank's ``/v1/loads`` entry with every section."""
    e, kv = engine, engine.kv
    used = kv.used()
    return {
        "timestamp": time.time(), "dp_rank": 0,
        "num_running_reqs": e.num_running(),
        "num_waiting_reqs": e.num_waiting(), "num_waiting_uncached_tokens": e.waiting_uncached_tokens(),
        "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": kv.private_tokens,
        "num_prealloc_ready_tokens": 0, "max_total_num_tokens": kv.capacity,
        "max_running_requests": info.profile.capacity.max_running_requests,
        "token_usage": round(used / kv.capacity, 4), "gen_throughput": e.gen_throughput(),
        "cache_hit_rate": e.cache_hit_rate(),
        "utilization": round(utilization(info, e), 4),
        "total_prefill_uncached_tokens": e.stats.prompt_tokens_total - e.stats.cached_tokens_total,
        # Wall time, as a real worker reports it (the engine counts model time).
        "total_prefill_busy_us": int(e.stats.prefill_busy_s * info.time_scale * 1e6),
        "decode_moments": [0.0] * 6,
        "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": kv.capacity},
        "disaggregation": {
            "mode": info.mode, "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": len(e.held) if info.mode == "prefill" else 0,
            "decode_prealloc_queue_reqs": len(e.bootstrapping),
            "decode_transfer_queue_reqs": len(e.transferring),
            "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0,
        },
        "queues": {"waiting": e.num_waiting(), "grammar": 0, "paused": 0,
                   "retracted": e.stats.num_retractions_total, "prealloc_ready": 0},
    }


def loads(info: WorkerInfo, engine: EmulatedEngine, include: str | None) -> tuple[dict[str, Any], int]:
    """The ``/v1/loads`` body and status; ``include`` picks sections as SGLang's parameter does."""
    entry = load(info, engine)
    if include:
        wanted = {s.strip() for s in include.split(",")}
        if not wanted <= LOADS_SECTIONS:
            return {"object": "error", "message": f"unknown include section(s): "
                    f"{', '.join(sorted(wanted - LOADS_SECTIONS))}", "type": "400", "code": 400}, 400
        if "all" not in wanted:
            for section, key in (("memory", "memory"), ("disagg", "disaggregation"), ("queues", "queues")):
                if section not in wanted:
                    entry.pop(key)
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "version": "0.5.23", "accelerator": None, "num_accelerators": 1, "loads": [entry],
    }, 200
