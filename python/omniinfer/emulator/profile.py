"""Worker profiles: what model an emulated worker claims to serve and how fast its hardware is.

A profile is a YAML file (shipped ones live in ``profiles/``) with four sections:

``model``     what /model_info and /server_info report (path, type, context length, vocab);
``capacity``  the scheduler's limits (KV pool size, chunked-prefill budget, running requests);
``cost``      the coefficients of :class:`LinearCostModel` (model seconds);
``transfer``  the KV-transfer bandwidth model used in PD mode;

and two optional ones, off when absent (``sparse.py``): ``moe`` (:class:`MoeConfig`, the expert
imbalance term) and ``attn_pattern`` (:class:`AttnPattern`, compressed attention layers).

Every shipped profile writes the source of each number beside it as a YAML comment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omniinfer.emulator.interfaces import CostModel, PrefillItem
from omniinfer.emulator.sparse import AttnPattern, MoeConfig


class ProfileError(ValueError):
    """A profile file is missing, unreadable or has a bad field; the message names it."""


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model_path: str
    served_model_name: str
    model_type: str = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    context_length: int = 8192
    vocab_size: int = 49152
    eos_token_id: int = 2
    default_system_prompt: str = ""  # the chat template's system message when none is sent


@dataclasses.dataclass(frozen=True)
class Capacity:
    max_total_tokens: int = 16384  # KV pool, tokens
    chunked_prefill_size: int = 4096  # token budget of one prefill pass
    max_prefill_tokens: int = 16384  # admission budget of one prefill batch
    max_running_requests: int = 2048
    new_token_ratio: float = 0.7  # share of max_new_tokens reserved at admission (SGLang's default)
    radix_cache: bool = True
    decode_radix_cache: bool = False  # SGLang disables the radix cache on PD decode workers


@dataclasses.dataclass(frozen=True)
class CostCoefficients:
    prefill_base_s: float = 0.0  # per prefill pass
    prefill_per_request_s: float = 0.0  # per request in the pass
    prefill_per_token_s: float = 0.0  # per computed token
    prefill_attention_s: float = 0.0  # per computed token per token attended (quadratic part)
    # Per request decoding while a prefill pass runs. On a small CPU host the running requests'
    # output path (detokenizer, HTTP streaming) competes with the forward pass for the cores;
    # on an accelerator it is ~0.
    prefill_per_running_request_s: float = 0.0
    decode_base_s: float = 0.0  # per decode step
    decode_per_request_s: float = 0.0  # per running request
    decode_per_kv_token_s: float = 0.0  # per KV token read in the step
    request_overhead_s: float = 0.0  # tokenization + HTTP, before the request reaches the scheduler


@dataclasses.dataclass(frozen=True)
class Transfer:
    kv_bytes_per_token: float = 0.0
    bandwidth_gb_s: float = 10.0  # GB/s = 1e9 bytes/s
    latency_s: float = 0.0
    bootstrap_timeout_s: float = 300.0  # a decode request whose prefill never comes fails after this


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model: ModelInfo
    capacity: Capacity
    cost: CostCoefficients
    transfer: Transfer
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)
    attn_pattern: AttnPattern = dataclasses.field(default_factory=AttnPattern)

    def cost_model(self) -> LinearCostModel:
        return LinearCostModel(self.cost, self.transfer, self.attn_pattern)

    def with_sparse(self, moe: MoeConfig | None = None, attn_pattern: AttnPattern | None = None) -> Profile:
        """This profile with its MoE and/or attention-pattern settings replaced."""
        return dataclasses.replace(self, moe=moe or self.moe, attn_pattern=attn_pattern or self.attn_pattern)

    def with_cost(self, **changes: float) -> Profile:
        return dataclasses.replace(self, cost=dataclasses.replace(self.cost, **changes))

    def with_capacity(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, capacity=dataclasses.replace(self.capacity, **changes))

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["model"]["architectures"] = list(self.model.architectures)
        return data


class LinearCostModel(CostModel):
    """Pass times linear in tokens, requests and attended KV (plus a quadratic prefill term).

    prefill = base + per_running_request·running + Σ_req (per_request + per_token·n
              + attention·pairs(n, ctx))
    decode  = base + per_request·batch + per_kv_token·Σ kv
    transfer = latency + kv_tokens(tokens)·kv_bytes_per_token / bandwidth

    ``pairs`` and ``kv_tokens`` are the attention pattern's (:class:`AttnPattern`): dense,
    ``n·(ctx + n/2)`` and ``tokens``; with compressed layers, those layers' sink + recent share.
    The engine passes ``Σ kv`` already through ``kv_tokens``, one request at a time.
    """

    def __init__(self, cost: CostCoefficients, transfer: Transfer, pattern: AttnPattern | None = None) -> None:
        self.c = cost
        self.t = transfer
        self.pattern = pattern or AttnPattern()

    def prefill_time(self, items: Sequence[PrefillItem], running: int = 0) -> float:
        c = self.c
        total = c.prefill_base_s + c.prefill_per_running_request_s * running
        for n, ctx in items:
            total += c.prefill_per_request_s + c.prefill_per_token_s * n
            total += c.prefill_attention_s * self.pattern.attention_pairs(n, ctx)
        return total

    def decode_time(self, batch_size: int, kv_tokens: float) -> float:
        c = self.c
        return c.decode_base_s + c.decode_per_request_s * batch_size + c.decode_per_kv_token_s * kv_tokens

    def kv_bytes(self, tokens: int) -> float:
        """Bytes of the KV of ``tokens`` prompt tokens a PD transfer moves."""
        return self.pattern.kv_tokens(tokens) * self.t.kv_bytes_per_token

    def transfer_time(self, tokens: int) -> float:
        t = self.t
        return t.latency_s + self.kv_bytes(tokens) / (t.bandwidth_gb_s * 1e9)


def _section(cls: type, raw: Any, where: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        default = getattr(cls, key, None) if key in fields else None
        if key == "architectures":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ProfileError(f"{where}.{key}: expected a list of strings")
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ProfileError(f"{where}.{key}: expected true/false, got {value!r}")
        elif isinstance(default, (int, float)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ProfileError(f"{where}.{key}: expected a number, got {value!r}")
            if value < 0:
                raise ProfileError(f"{where}.{key}: must be >= 0, got {value}")
            value = int(value) if isinstance(default, int) else float(value)
        values[key] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:  # a bad value of a sparse section says so (ValueError)
        raise ProfileError(f"{where}: {exc}") from None


def profile_from_dict(raw: Any, source: str = "<profile>") -> Profile:
    if not isinstance(raw, dict):
        raise ProfileError(f"{source}: expected a YAML mapping at the top level")
    unknown = sorted(set(raw) - {"name", "description", "model", "capacity", "cost", "transfer", "moe",
                                 "attn_pattern"})
    if unknown:
        raise ProfileError(f"{source}: unknown section(s) {', '.join(unknown)}")
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict) or "model_path" not in model_raw:
        raise ProfileError(f"{source}: model.model_path is required")
    model_raw = {"served_model_name": model_raw["model_path"], **model_raw}
    profile = Profile(
        name=str(raw.get("name") or Path(source).stem),
        description=str(raw.get("description") or ""),
        model=_section(ModelInfo, model_raw, f"{source}: model"),
        capacity=_section(Capacity, raw.get("capacity"), f"{source}: capacity"),
        cost=_section(CostCoefficients, raw.get("cost"), f"{source}: cost"),
        transfer=_section(Transfer, raw.get("transfer"), f"{source}: transfer"),
        moe=_section(MoeConfig, raw.get("moe"), f"{source}: moe"),
        attn_pattern=_section(AttnPattern, raw.get("attn_pattern"), f"{source}: attn_pattern"),
    )
    if profile.capacity.max_total_tokens < 1 or profile.capacity.chunked_prefill_size < 1:
        raise ProfileError(f"{source}: capacity.max_total_tokens and chunked_prefill_size must be >= 1")
    if profile.transfer.bandwidth_gb_s <= 0:
        raise ProfileError(f"{source}: transfer.bandwidth_gb_s must be > 0")
    return profile


def shipped_profiles() -> list[str]:
    folder = resources.files("omniinfer.emulator").joinpath("profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str | Path) -> Profile:
    """Load a shipped profile by name (``cpu-smollm2``) or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        try:
            text = path.read_text("utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
        source = str(path)
    else:
        shipped = resources.files("omniinfer.emulator").joinpath("profiles", f"{name_or_path}.yaml")
        if not shipped.is_file():
            raise ProfileError(
                f"no profile named {name_or_path!r}; shipped: {', '.join(shipped_profiles())}"
            )
        text = shipped.read_text("utf-8")
        source = f"{name_or_path}.yaml"
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}") from None
    return profile_from_dict(raw, source)


def dump_profile(profile: Profile) -> str:
    return yaml.safe_dump(profile.to_dict(), sort_keys=False)
