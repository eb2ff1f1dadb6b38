"""The two sparse techniques in an emulated worker: expert placement (MoE) and attention patterns.

Pure models, independent of the server: the profile carries their settings, the engine asks
them once per forward pass (:meth:`MoeClock.step`) and for every KV size (:class:`AttnPattern`).

**MoE.** Under expert parallelism each MoE layer waits for its busiest device, so a pass's
expert time grows with the imbalance B = max device load / mean device load of the placement in
force against the pass's expert load::

    pass = (1 - share) * t + share * t * B / b_ref

``t`` is the profile's pass time (:class:`~omniinfer.emulator.profile.LinearCostModel`), ``share``
the part of it spent in MoE layers and ``b_ref`` the B that ``t`` was measured at. Default
``b_ref = 1``: the profile's times are taken as those of a perfectly balanced placement
(ASSUMPTION: no shipped profile records the B of the run it comes from; one that does sets it).

The load is real router counts (``omniinfer/data/moe/olmoe/expert_counts.json``: per-domain
counts of OLMoE-1B-7B and Mixtral-8x7B at 3 recorded layers) replayed as the drifting stream of
:func:`omniinfer.placement.simulate.drift_workload` (regime shifts, a random walk of the domain
mix, each window a multinomial sample of 32,768 routed assignments). Window 0 seeds every
planner's first plan at no cost, as in ``omniinfer placement simulate``; window ``w >= 1`` is the
load of passes ``(w-1)·N .. w·N-1`` (``N = window_steps``, default 100 = the served
``--omni-placement-interval``). A pass's B is the mean of the recorded layers' B: every layer
carries the same volume and waits for its own busiest device, so Σ max / Σ mean = mean B. The
stream is endless: chunk ``c`` of ``DriftConfig.windows`` windows uses seed ``seed·1,000,003 + c``
(a chunk starts on a regime shift, as every 30th window does anyway).

Placements (``placement``), all planned inside the emulator by the project's own planners:

``none``    SGLang's trivial layout: expert ``e`` on device ``e // (E/R)``, no redundant slot;
``static``  our Algorithm 1 (:func:`~omniinfer.placement.static.plan_static`) once, on window 0;
``eplb``    :class:`~omniinfer.placement.simulate.EplbPeriodic`: SGLang's deepseek EPLB every
            ``eplb_period`` windows (default 10: SGLang's ``--eplb-rebalance-num-iterations``
            1000 / 100 passes); the worker stalls while the weights move (SGLang's updater
            copies them synchronously in the forward loop): ``stall = bytes / bandwidth``;
``omni``    :class:`~omniinfer.placement.simulate.Omni`, the dynamic controller with the served
            config (``planner_config(OmniConfig())``: predictor ema-shift, trigger 1.05, margin
            0.01) after every window; a new placement is staged in the background and takes
            effect once its bytes have moved, passes meanwhile run on the old one (no stall);
``oracle``  our Algorithm 1 on the judged window itself, free: a floor, not a policy.

Migration bytes = experts moved at the recorded layers x ``expert_bytes`` (default: bf16 gate, up
and down projections of one expert, :data:`~omniinfer.placement.simulate.EXPERT_BYTES`) x
(``layers``, default the model's MoE layers, / recorded layers): the recorded layers stand in for
all of them (ASSUMPTION). They move at ``migration_gb_s``, the rate of the whole EP group
(default 40 GB/s, ASSUMPTION: the shipped profiles' RDMA figure; intra-node links are faster). The clock of a pending migration is the engine's model time, so
it progresses while passes run, which is when the placement matters.

``skew`` s tilts the routing before the replay: each domain's per-layer expert shares ``p`` become
``p^s / Σ p^s`` (s = 1 the recorded routing, 0 uniform, > 1 more concentrated: the spread of the
log shares around their mean is multiplied by s).

**Attention patterns** (:class:`AttnPattern`): see the class.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import numpy as np

from omniinfer.placement.dynamic import DynamicConfig
from omniinfer.placement.layout import Placement
from omniinfer.placement.loads import read_domain_counts
from omniinfer.placement.simulate import (
    EXPERT_BYTES,
    DriftConfig,
    EplbPeriodic,
    Omni,
    Policy,
    drift_workload,
)
from omniinfer.placement.static import check_shape, plan_static

# Routed experts per layer and MoE layers of the whole model, from each model's config.json:
# OLMoE-1B-7B num_experts 64, num_hidden_layers 16; Mixtral-8x7B num_local_experts 8, 32 layers.
MOE_MODELS: dict[str, tuple[int, int]] = {"olmoe": (64, 16), "mistral": (8, 32)}
PLACEMENTS = ("none", "static", "eplb", "omni", "oracle")
CHUNK_SEED_STRIDE = 1_000_003


@dataclasses.dataclass(frozen=True)
class AttnPattern:
    """OmniAttn's pattern as the emulator sees it: a share of the layers keeps sink + recent KV.

    A compressed layer keeps the KV of tokens ``[0, sink)`` and of the last ``recent`` tokens, so a
    sequence of ``L`` tokens holds ``min(L, sink + recent)`` of them there. With ``c`` the share of
    compressed layers (layers taken as equal in KV size and attention cost), one sequence is worth

        kv_tokens(L) = (1 - c)·L + c·min(L, sink + recent)      tokens of all layers,

    which is its KV-pool footprint, the KV a decode step reads for it and what a PD transfer
    moves for it (full layers whole, compressed layers their sink + window). A prefill query at
    position ``p`` attends ``p`` keys in a full layer and ``min(p, sink + recent)`` in a compressed
    one; :meth:`attention_pairs` integrates that over the pass's queries. ``c = 0`` (the default)
    is no pattern, and every method returns exactly the dense figure.

    Defaults of ``sink``/``recent``: 128 / 384, the project's searched SmolLM2-135M patterns
    (``omniinfer/attn/patterns/smollm2-135m.json``: 16 of 30 layers at 0.8 % perplexity cost).
    """

    compressed_fraction: float = 0.0
    sink: int = 128
    recent: int = 384

    def __post_init__(self) -> None:
        if not 0.0 <= self.compressed_fraction <= 1.0:
            raise ValueError(f"compressed_fraction must be in [0, 1], got {self.compressed_fraction}")
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"sink must be >= 0 and recent >= 1, got {self.sink} and {self.recent}")

    @property
    def active(self) -> bool:
        return self.compressed_fraction > 0

    @property
    def window(self) -> int:
        """Tokens a compressed layer keeps of a long sequence."""
        return self.sink + self.recent

    def window_tokens(self, length: int) -> int:
        """Tokens of a ``length``-token sequence held in the compressed layers (0: no pattern)."""
        return min(length, self.window) if self.active else 0

    def kv_tokens(self, length: int) -> float:
        """All-layer-token worth of a ``length``-token sequence's KV (``length`` itself if dense)."""
        if not self.active:
            return length
        c = self.compressed_fraction
        return (1.0 - c) * length + c * min(length, self.window)

    def attention_pairs(self, new_tokens: int, context_tokens: int) -> float:
        """(query, key) pairs of a prefill of ``new_tokens`` after ``context_tokens``: dense,
        ``n·(ctx + n/2)``; a compressed layer caps each query's keys at ``sink + recent``."""
        dense = new_tokens * (context_tokens + new_tokens / 2.0)
        if not self.active:
            return dense
        c = self.compressed_fraction
        capped = _capped_pairs(context_tokens, context_tokens + new_tokens, self.window)
        return (1.0 - c) * dense + c * capped

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "active": self.active, "window": self.window}


def _capped_pairs(start: float, end: float, cap: float) -> float:
    """∫ min(p, cap) dp over [start, end]: keys attended by the queries at those positions."""
    if end <= cap:
        return (end * end - start * start) / 2.0
    if start >= cap:
        return (end - start) * cap
    return (cap * cap - start * start) / 2.0 + (end - cap) * cap


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Settings of the MoE term (module docstring). ``share = 0`` (the default) turns it off."""

    share: float = 0.0  # part of a pass spent in MoE layers, in [0, 1]
    placement: str = "none"  # one of PLACEMENTS
    model: str = "olmoe"  # whose router counts: olmoe (64 experts, top-8) or mistral (8, top-2)
    ranks: int = 8  # EP devices (ASSUMPTION: one 8-device node; divides both models' experts)
    redundant: int = 0  # redundant expert slots per layer (SGLang --ep-num-redundant-experts 0)
    skew: float = 1.0  # exponent on the expert shares (module docstring)
    window_steps: int = 100  # passes per window (served --omni-placement-interval 100)
    eplb_period: int = 10  # windows between EPLB runs (SGLang's 1000 iterations / 100)
    b_ref: float = 1.0  # the B the profile's pass times were measured at (ASSUMPTION: balanced)
    expert_bytes: int = 0  # bytes of one expert of one layer; 0: EXPERT_BYTES[model]
    layers: int = 0  # MoE layers of the served model; 0: the counts model's (MOE_MODELS)
    migration_gb_s: float = 40.0  # expert-weight copy bandwidth, GB/s (ASSUMPTION)
    seed: int = 0  # of the drift stream

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.model not in MOE_MODELS:
            raise ValueError(f"model must be one of {', '.join(MOE_MODELS)}, got {self.model!r}")
        if self.window_steps < 1 or self.eplb_period < 1:
            raise ValueError("window_steps and eplb_period must be >= 1")
        if not self.b_ref > 0 or not self.migration_gb_s > 0:
            raise ValueError("b_ref and migration_gb_s must be > 0")
        if self.skew < 0 or self.expert_bytes < 0 or self.layers < 0:
            raise ValueError("skew, expert_bytes and layers must be >= 0")
        check_layout(MOE_MODELS[self.model][0], self.ranks, self.redundant, self.placement)

    @property
    def active(self) -> bool:
        return self.share > 0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "active": self.active}


def check_layout(num_experts: int, ranks: int, redundant: int, placement: str) -> None:
    """Raise ValueError unless ``placement`` can lay ``num_experts`` out on ``ranks`` devices."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if placement == "none":  # the trivial layout has no redundant slot
        if num_experts % ranks:
            raise ValueError(f"{ranks} ranks do not divide {num_experts} experts")
    else:
        check_shape(num_experts, ranks, redundant)  # a PlacementError is a ValueError


class MoeStep(NamedTuple):
    """What one forward pass gets from the MoE clock."""

    factor: float  # multiplies the pass's cost-model time
    stall_s: float  # synchronous pause before the pass (an EPLB weight copy), model seconds
    b: float  # imbalance of the placement in force against the pass's load
    window: int  # the stream window the pass belongs to


def skew_counts(counts: np.ndarray, skew: float) -> np.ndarray:
    """Each layer's expert shares raised to ``skew`` and renormalised; the volume is kept."""
    counts = np.asarray(counts, dtype=float)
    if skew == 1.0:
        return counts
    volume = counts.sum(axis=1, keepdims=True)
    tilted = (counts / volume) ** skew
    return tilted / tilted.sum(axis=1, keepdims=True) * volume


def contiguous(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    """SGLang's trivial layout: device ``d`` holds experts ``d·E/R .. (d+1)·E/R - 1``."""
    row = np.arange(num_experts).reshape(num_devices, num_experts // num_devices)
    return Placement(np.repeat(row[None], num_layers, axis=0), num_experts)


def served_planner_config() -> DynamicConfig:
    """The planner a server launched with ``--enable-omni-placement`` and no other flag runs."""
    from omniinfer.flags import OmniConfig
    from omniinfer.placement.served import planner_config

    return planner_config(OmniConfig())


class _Fixed(Policy):
    """A placement that never changes."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def observe(self, counts: np.ndarray) -> None:
        pass


class MoeClock:
    """Which window, which placement, B per pass and the migrations' cost (module docstring).

    The engine calls :meth:`step` once per forward pass with its model clock; nothing else
    advances the clock. ``domain_counts`` (tests) replaces the shipped router counts.
    """

    def __init__(self, config: MoeConfig, domain_counts: dict[str, np.ndarray] | None = None,
                 drift: DriftConfig | None = None) -> None:
        self.config = config
        raw = domain_counts if domain_counts is not None else read_domain_counts(model=config.model)
        self.domains = {name: skew_counts(c, config.skew) for name, c in raw.items()}
        self.num_layers, self.num_experts = next(iter(self.domains.values())).shape
        check_layout(self.num_experts, config.ranks, config.redundant, config.placement)
        self.layer_scale = (config.layers or MOE_MODELS[config.model][1]) / self.num_layers
        self.expert_bytes = config.expert_bytes or EXPERT_BYTES[config.model]
        self.drift = drift or DriftConfig()
        self._chunk: tuple[int, np.ndarray] | None = None
        self.policy = self._make_policy(self._counts(0))
        self.in_force = self.policy.placement
        self._version = 0  # bumped whenever in_force changes (keys the B cache)
        self._b_cache: tuple[tuple[int, int], float] | None = None
        self.pending: collections.deque[tuple[float, Placement]] = collections.deque()
        self.window = 1
        self.steps = 0
        self.b_sum = 0.0
        self.last = MoeStep(1.0, 0.0, 1.0, 1)
        self.rebalances = 0  # placements the policy adopted
        self.experts_moved = 0
        self.bytes_moved = 0.0
        self.stalls = 0
        self.stall_total_s = 0.0

    def _make_policy(self, first: np.ndarray) -> Policy:
        cfg = self.config
        if cfg.placement in ("none", "oracle"):
            return _Fixed(contiguous(self.num_layers, self.num_experts, cfg.ranks))
        if cfg.placement == "static":
            return _Fixed(plan_static(first, cfg.ranks, cfg.redundant))
        if cfg.placement == "eplb":
            return EplbPeriodic(first, cfg.ranks, cfg.redundant, period=cfg.eplb_period)
        return Omni(first, cfg.ranks, cfg.redundant, dynamic=served_planner_config())

    def _counts(self, window: int) -> np.ndarray:
        """Counts ``[L, E]`` of stream window ``window`` (windows are asked for in order)."""
        chunk, index = divmod(window, self.drift.windows)
        if self._chunk is None or self._chunk[0] != chunk:
            seed = self.config.seed * CHUNK_SEED_STRIDE + chunk
            counts, _ = drift_workload(self.domains, dataclasses.replace(self.drift, seed=seed))
            self._chunk = (chunk, counts)
        return self._chunk[1][index]

    # -- the per-pass call ----------------------------------------------------------------------
    def step(self, now_s: float) -> MoeStep:
        """One forward pass starting at model time ``now_s``: its factor, stall and B.

        When the pass opens a new window the policy first observes the window that ended; an
        EPLB rebalance then stalls this pass, an omni migration is queued to land once its bytes
        have moved (counted from ``now_s``, after any migration still in flight).
        """
        cfg = self.config
        window = 1 + self.steps // cfg.window_steps
        stall = 0.0
        if window != self.window:
            stall = self._end_window(now_s)
            self.window = window
        while self.pending and self.pending[0][0] <= now_s + stall:
            self._set_in_force(self.pending.popleft()[1])
        b = self._b()
        factor = (1.0 - cfg.share) + cfg.share * b / cfg.b_ref
        self.steps += 1
        self.b_sum += b
        self.last = MoeStep(factor, stall, b, window)
        return self.last

    def _end_window(self, now_s: float) -> float:
        """The policy sees the window that ended; returns the stall it costs (EPLB only)."""
        policy = self.policy
        moved_before, rebalances_before = policy.moved, policy.rebalances
        policy.observe(self._counts(self.window))
        if policy.rebalances == rebalances_before:
            return 0.0
        moved = int(policy.moved - moved_before)
        size = moved * self.expert_bytes * self.layer_scale
        seconds = size / (self.config.migration_gb_s * 1e9)
        self.rebalances += 1
        self.experts_moved += moved
        self.bytes_moved += size
        if self.config.placement == "eplb":
            self._set_in_force(policy.placement)
            if seconds > 0:
                self.stalls += 1
                self.stall_total_s += seconds
            return seconds
        start = max(self.pending[-1][0], now_s) if self.pending else now_s
        self.pending.append((start + seconds, policy.placement))
        return 0.0

    def _set_in_force(self, placement: Placement) -> None:
        self.in_force = placement
        self._version += 1

    def _b(self) -> float:
        key = (self.window, self._version)
        if self._b_cache is not None and self._b_cache[0] == key:
            return self._b_cache[1]
        counts = self._counts(self.window)
        cfg = self.config
        placement = (plan_static(counts, cfg.ranks, cfg.redundant) if cfg.placement == "oracle"
                     else self.in_force)
        b = float(placement.imbalance(counts).mean())
        self._b_cache = (key, b)
        return b

    # -- reporting ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The settings and the live figures (for /server_info and /emulator/sparse)."""
        return {
            **self.config.as_dict(),
            "expert_bytes": self.expert_bytes, "num_experts": self.num_experts,
            "recorded_layers": self.num_layers, "layer_scale": self.layer_scale,
            "steps": self.steps, "window": self.window, "b": self.last.b,
            "b_mean": self.b_sum / self.steps if self.steps else None, "factor": self.last.factor,
            "rebalances": self.rebalances, "experts_moved": self.experts_moved,
            "bytes_moved": self.bytes_moved, "migrations_pending": len(self.pending),
            "stalls": self.stalls, "stall_s": self.stall_total_s,
        }
