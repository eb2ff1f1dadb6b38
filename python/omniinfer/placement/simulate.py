"""Drift simulation: plan on the past, be judged on the future, pay for every migrated expert.

The workload mixes real per-domain router counts with weights that drift every window (a random
walk) and jump at regime shifts; each window's counts are sampled from the mixture, so they
carry the sampling noise of a finite batch. Policies see windows 0..t-1 and choose the placement
that window t is judged on:

* ``omni``: Algorithm 2 (:class:`DynamicPlanner`);
* ``eplb-static``: SGLang's deepseek EPLB once, on window 0;
* ``eplb-periodic``: SGLang's deepseek EPLB every ``period`` windows on the counts recorded since
  the last rebalance, as SGLang's EPLBManager does every ``--eplb-rebalance-num-iterations``;
* ``oracle``: our Algorithm 1 on the judged window itself (a floor, not a policy).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from omniinfer.placement.dynamic import DynamicConfig, DynamicPlanner
from omniinfer.placement.layout import Placement, PlacementError
from omniinfer.placement.migration import align, experts_moved
from omniinfer.placement.static import check_shape, plan_static

# bf16 weights of one routed expert (gate, up and down projections)
EXPERT_BYTES = {
    "olmoe": 3 * 2048 * 1024 * 2,
    "olmoe-sft": 3 * 2048 * 1024 * 2,
    "olmoe-dpo": 3 * 2048 * 1024 * 2,
    "mistral": 3 * 4096 * 14336 * 2,
}


@dataclass
class DriftConfig:
    """Shape of the drifting workload."""

    windows: int = 120
    routed_per_window: int = 32768  # (token, top-k slot) assignments per window
    regime: int = 30  # windows between regime shifts
    drift: float = 0.15  # std of the per-window random walk of log mixture weights
    concentration: float = 0.5  # Dirichlet concentration of a new regime's mixture
    seed: int = 0


def mixture_weights(num_domains: int, cfg: DriftConfig, rng: np.random.Generator) -> np.ndarray:
    """Domain weights ``[W, D]``: a fresh Dirichlet draw per regime, a random walk inside."""
    out = np.empty((cfg.windows, num_domains))
    log_w = np.zeros(num_domains)
    for t in range(cfg.windows):
        if t % cfg.regime == 0:
            log_w = np.log(
                np.clip(rng.dirichlet(np.full(num_domains, cfg.concentration)), 1e-3, None)
            )
        else:
            log_w = log_w + rng.normal(0.0, cfg.drift, num_domains)
        w = np.exp(log_w - log_w.max())
        out[t] = w / w.sum()
    return out


def drift_workload(
    domain_counts: dict[str, np.ndarray], cfg: DriftConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled counts ``[W, L, E]`` and the mixture weights ``[W, D]`` behind them."""
    if cfg.windows < 2:
        raise PlacementError("the simulation needs at least 2 windows")
    if cfg.regime < 1 or cfg.routed_per_window < 1:
        raise PlacementError("regime length and routed tokens per window must be >= 1")
    rng = np.random.default_rng(cfg.seed)
    shares = np.stack([c / c.sum(axis=1, keepdims=True) for c in domain_counts.values()])
    weights = mixture_weights(shares.shape[0], cfg, rng)
    num_layers, num_experts = shares.shape[1:]
    counts = np.empty((cfg.windows, num_layers, num_experts))
    for t in range(cfg.windows):
        mix = np.tensordot(weights[t], shares, axes=1)
        for layer in range(num_layers):
            p = mix[layer] / mix[layer].sum()
            counts[t, layer] = rng.multinomial(cfg.routed_per_window, p)
    return counts, weights


# ---------------------------------------------------------------------------- policies


class Policy:
    """Holds a placement; ``observe`` sees a finished window and may change the placement."""

    placement: Placement
    moved = 0  # experts copied as the policy's runtime would copy them
    moved_aligned = 0  # experts copied had the same layouts been aligned device by device
    rebalances = 0

    def observe(self, counts: np.ndarray) -> None:
        raise NotImplementedError

    def _switch(self, new: Placement) -> None:
        self.moved += experts_moved(self.placement.slots, new.slots)
        self.moved_aligned += experts_moved(self.placement.slots, align(self.placement, new).slots)
        self.placement = new
        self.rebalances += 1


class EplbStatic(Policy):
    def __init__(
        self, first: np.ndarray, num_devices: int, num_redundant: int, **_: object
    ) -> None:
        from omniinfer.placement.peer import eplb_plan

        self.placement = eplb_plan(first, num_devices, num_redundant)

    def observe(self, counts: np.ndarray) -> None:
        pass


class EplbPeriodic(Policy):
    def __init__(
        self, first: np.ndarray, num_devices: int, num_redundant: int, period: int = 10, **_: object
    ) -> None:
        from omniinfer.placement.peer import eplb_plan

        self._plan = lambda c: eplb_plan(c, num_devices, num_redundant)
        self.placement = self._plan(first)
        self.period, self.seen, self.buffer = period, 0, np.zeros_like(first)

    def observe(self, counts: np.ndarray) -> None:
        self.buffer = self.buffer + counts
        self.seen += 1
        if self.seen % self.period == 0:
            self._switch(self._plan(self.buffer))
            self.buffer = np.zeros_like(self.buffer)


class Omni(Policy):
    def __init__(
        self,
        first: np.ndarray,
        num_devices: int,
        num_redundant: int,
        dynamic: DynamicConfig | None = None,
        **_: object,
    ) -> None:
        self.planner = DynamicPlanner(plan_static(first, num_devices, num_redundant), dynamic)
        self.planner.observe(first)
        self.placement = self.planner.placement

    def observe(self, counts: np.ndarray) -> None:
        step = self.planner.observe(counts)
        if step.adopted_layers:
            self.moved += step.experts_moved
            self.moved_aligned += step.experts_moved
            self.rebalances += 1
        self.placement = step.placement


POLICIES: dict[str, Callable[..., Policy]] = {
    "omni": Omni,
    "eplb-static": EplbStatic,
    "eplb-periodic": EplbPeriodic,
}


# ---------------------------------------------------------------------------- running


def run_policy(
    name: str, counts: np.ndarray, num_devices: int, num_redundant: int, **kwargs: object
) -> tuple[np.ndarray, Policy]:
    """B per judged window and layer ``[W-1, L]``; window 0 only seeds the first plan."""
    policy = POLICIES[name](counts[0], num_devices, num_redundant, **kwargs)
    out = np.empty((counts.shape[0] - 1, counts.shape[1]))
    for t in range(1, counts.shape[0]):
        out[t - 1] = policy.placement.imbalance(counts[t])
        policy.observe(counts[t])
    return out, policy


def oracle(counts: np.ndarray, num_devices: int, num_redundant: int) -> np.ndarray:
    """B of our static plan made on the judged window itself."""
    return np.stack([plan_static(c, num_devices, num_redundant).imbalance(c) for c in counts[1:]])


def summarize(b: np.ndarray, policy: Policy | None, expert_bytes: int) -> dict:
    row = {
        "mean_b": float(b.mean()),
        "p99_b": float(np.percentile(b, 99)),
        "max_b": float(b.max()),
        "mean_excess": float(b.mean() - 1.0),
    }
    if policy is not None:
        row.update(
            experts_migrated=int(policy.moved),
            experts_migrated_if_aligned=int(policy.moved_aligned),
            bytes_migrated=int(policy.moved) * expert_bytes,
            rebalances=int(policy.rebalances),
        )
    return row


def simulate(
    domain_counts: dict[str, np.ndarray],
    num_devices: int,
    num_redundant: int,
    drift: DriftConfig,
    policies: tuple[str, ...] = ("omni", "eplb-static", "eplb-periodic"),
    period: int = 10,
    dynamic: DynamicConfig | None = None,
    expert_bytes: int = 0,
    with_oracle: bool = True,
    progress: bool = False,
) -> dict:
    """Run the policies on one drifting workload; returns the summary and the B series."""
    num_experts = next(iter(domain_counts.values())).shape[1]
    check_shape(num_experts, num_devices, num_redundant)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise PlacementError(f"unknown policy {unknown[0]!r} (have: {', '.join(POLICIES)})")
    counts, weights = drift_workload(domain_counts, drift)
    names = list(policies) + (["oracle"] if with_oracle else [])
    if progress:
        from tqdm import tqdm

        names_iter = tqdm(names, desc="policies", leave=False)
    else:
        names_iter = names
    summary, series = {}, {}
    for name in names_iter:
        if name == "oracle":
            b, policy = oracle(counts, num_devices, num_redundant), None
        else:
            b, policy = run_policy(
                name, counts, num_devices, num_redundant, period=period, dynamic=dynamic
            )
        summary[name] = summarize(b, policy, expert_bytes)
        series[name] = b.mean(axis=1).tolist()
    return {
        "config": {
            "num_devices": num_devices,
            "num_redundant_experts": num_redundant,
            "num_experts": num_experts,
            "num_layers": int(counts.shape[1]),
            "period": period,
            "expert_bytes": expert_bytes,
            "domains": list(domain_counts),
            "drift": asdict(drift),
            "dynamic": asdict(dynamic or DynamicConfig()),
        },
        "policies": summary,
        "b_over_time": series,
        "mixture_weights": weights.round(4).tolist(),
    }


def write_outputs(result: dict, out_dir: Path, title: str = "") -> list[Path]:
    """``summary.json`` and ``b_over_time.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.json"
    summary.write_text(json.dumps(result, indent=2) + "\n")
    png = out_dir / "b_over_time.png"
    plot_b_over_time(result, png, title)
    return [summary, png]


def plot_b_over_time(result: dict, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, series in result["b_over_time"].items():
        row = result["policies"][name]
        moved = f", {row['experts_migrated']} moved" if "experts_migrated" in row else ""
        ax.plot(
            range(1, len(series) + 1),
            series,
            label=f"{name} (mean {row['mean_b']:.3f}{moved})",
            lw=1.2,
            ls="--" if name == "oracle" else "-",
        )
    regime = result["config"]["drift"]["regime"]
    for t in range(regime, len(next(iter(result["b_over_time"].values()))) + 1, regime):
        ax.axvline(t, color="grey", lw=0.5, ls=":")
    cfg = result["config"]
    ax.set_xlabel("window (dotted: regime shift)")
    ax.set_ylabel("B = max / mean device load (mean over layers)")
    ax.set_title(
        title
        or f"{cfg['num_devices']} devices + {cfg['num_redundant_experts']} redundant, "
        f"{cfg['num_experts']} experts, {cfg['num_layers']} layers"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
