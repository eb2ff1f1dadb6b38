"""Algorithm 2, dynamic placement: watch the load, predict the next window, repair cheaply.

Each window the controller feeds the observed counts to a predictor, measures the imbalance B
the current placement would have under the predicted load, and for layers above ``trigger``
plans a new placement. Two candidates compete: a repair of the current placement (a few
single-slot moves, each chosen for the largest drop in the busiest device's load per copied
expert) and a fresh Algorithm 1 plan aligned to the current devices. A candidate is adopted only
if it lowers the predicted B by more than ``margin``; between candidates, predicted B plus
``move_cost`` per copied expert decides. Predictors live in a registry, so adding one is one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from omniinfer.placement.layout import Placement, PlacementError, Predictor, layer_imbalance
from omniinfer.placement.migration import align, align_layer, experts_moved
from omniinfer.placement.static import plan_layer

# ---------------------------------------------------------------------------- predictors

PREDICTORS: dict[str, Callable[..., Predictor]] = {}
# What a span of N windows (``--omni-placement-window N``) means to each predictor, as the
# keyword arguments it takes; a predictor without an entry has no span and refuses one.
WINDOW_ARGS: dict[str, Callable[[int], dict[str, float]]] = {}
# The longest span accepted: ``window`` keeps N windows of [layers, experts] shares and averages
# them at every decision (1,000 of DeepSeek-V3's 58 x 256 float64 shares: ~120 MB, ~15 M adds);
# at the default 100 passes per window that is 100,000 passes of history.
MAX_SPAN = 1000


def register_predictor(
    name: str, window: Callable[[int], dict[str, float]] | None = None
) -> Callable[[type], type]:
    """Class decorator: make a predictor available by name (``--predictor NAME``); ``window``
    turns a span of N windows into the predictor's own arguments (None: it has no span)."""

    def wrap(cls: type) -> type:
        PREDICTORS[name] = cls
        if window is not None:
            WINDOW_ARGS[name] = window
        return cls

    return wrap


def ema_span(n: int) -> dict[str, float]:
    """The EMA weight whose centre of mass is that of an N-window mean: 2 / (N + 1)."""
    return {"alpha": 2.0 / (n + 1)}


def window_args(predictor: str, window: int | None) -> dict[str, float]:
    """The arguments that give ``predictor`` a span of ``window`` windows ({} for None).

    Raises PlacementError for an unknown predictor, a span below 1 or above ``MAX_SPAN``, or a
    predictor that has no span (``last``), naming the predictors that have one."""
    if window is None:
        return {}
    if predictor not in PREDICTORS:
        raise PlacementError(f"unknown predictor {predictor!r}")
    if window < 1:
        raise PlacementError(f"a span must be >= 1 window, got {window}")
    if window > MAX_SPAN:
        raise PlacementError(f"a span must be at most {MAX_SPAN} windows, got {window}")
    span = WINDOW_ARGS.get(predictor)
    if span is None:
        raise PlacementError(f"predictor {predictor!r} has no moving-average span (the ones "
                             f"that do: {', '.join(sorted(WINDOW_ARGS))})")
    return span(int(window))


def make_predictor(name: str, **kwargs: float) -> Predictor:
    if name not in PREDICTORS:
        raise PlacementError(f"unknown predictor {name!r} (have: {', '.join(sorted(PREDICTORS))})")
    return PREDICTORS[name](**kwargs)


def _shares(counts: np.ndarray) -> np.ndarray:
    total = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts, dtype=float), where=total > 0)


class _Base:
    """Predicts shares of the load (B does not depend on the volume) times the last volume."""

    def __init__(self) -> None:
        self.volume: np.ndarray | None = None

    def update(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts, dtype=float)
        self.volume = counts.sum(axis=1, keepdims=True)
        self._observe(_shares(counts), counts)

    def predict(self) -> np.ndarray:
        if self.volume is None:
            raise PlacementError("the predictor has seen no window yet")
        return np.clip(self._forecast(), 0.0, None) * self.volume

    def _observe(self, shares: np.ndarray, counts: np.ndarray) -> None:
        raise NotImplementedError

    def _forecast(self) -> np.ndarray:
        raise NotImplementedError


@register_predictor("last")
class LastWindow(_Base):
    """The next window looks like the last one (what a periodic rebalancer assumes)."""

    def _observe(self, shares, counts):
        self.value = shares

    def _forecast(self):
        return self.value


@register_predictor("window", window=lambda n: {"size": n})
class WindowMean(_Base):
    """Mean of the last ``size`` windows: less sampling noise, slower to follow a shift."""

    def __init__(self, size: int = 10) -> None:
        super().__init__()
        self.size = int(size)
        self.history: list[np.ndarray] = []

    def _observe(self, shares, counts):
        self.history = (self.history + [shares])[-self.size :]

    def _forecast(self):
        return np.mean(self.history, axis=0)


@register_predictor("ema", window=ema_span)
class Ema(_Base):
    """Exponentially weighted moving average of the shares."""

    def __init__(self, alpha: float = 0.3) -> None:
        super().__init__()
        self.alpha = alpha
        self.level: np.ndarray | None = None

    def _observe(self, shares, counts):
        self.level = (
            shares if self.level is None else self.alpha * shares + (1 - self.alpha) * self.level
        )

    def _forecast(self):
        return self.level


@register_predictor("ema-trend", window=ema_span)
class EmaTrend(_Base):
    """EMA plus a damped trend (Holt): follows a steady drift without lagging behind it."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.1, damping: float = 0.8) -> None:
        super().__init__()
        self.alpha, self.beta, self.damping = alpha, beta, damping
        self.level: np.ndarray | None = None
        self.trend: np.ndarray | None = None

    def _observe(self, shares, counts):
        if self.level is None:
            self.level, self.trend = shares, np.zeros_like(shares)
            return
        prev = self.level
        self.level = self.alpha * shares + (1 - self.alpha) * (prev + self.damping * self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.damping * self.trend

    def _forecast(self):
        return self.level + self.damping * self.trend


@register_predictor("ema-shift", window=ema_span)
class EmaShift(EmaTrend):
    """EMA plus trend that restarts from the last window when that window differs from the
    forecast by more than sampling noise explains (a regime shift), so it neither averages
    noise away too slowly nor keeps following a workload that is gone."""

    def __init__(self, alpha: float = 0.3, beta: float = 0.1, damping: float = 0.8, z: float = 3.0):
        super().__init__(alpha, beta, damping)
        self.z = z

    def _observe(self, shares, counts):
        if self.level is not None:
            expected = self.level + self.damping * self.trend
            routed = np.maximum(counts.sum(axis=1, keepdims=True), 1.0)
            noise = np.sqrt(np.clip(expected, 1e-12, None) / routed).sum(axis=1)
            distance = np.abs(shares - expected).sum(axis=1)
            shifted = distance > self.z * noise * np.sqrt(2 / np.pi) + 1e-12
            if shifted.any():
                self.level[shifted] = shares[shifted]
                self.trend[shifted] = 0.0
                unshifted = ~shifted
                if not unshifted.any():
                    return
                sub = EmaTrend(self.alpha, self.beta, self.damping)
                sub.level, sub.trend = self.level[unshifted], self.trend[unshifted]
                sub._observe(shares[unshifted], counts[unshifted])
                self.level[unshifted], self.trend[unshifted] = sub.level, sub.trend
                return
        super()._observe(shares, counts)


# ---------------------------------------------------------------------------- repair


def _device_expert_counts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    out = np.zeros((slots.shape[0], num_experts), dtype=np.int64)
    for d, row in enumerate(slots):
        used = row[row >= 0]
        np.add.at(out[d], used, 1)
    return out


def repair_layer(
    slots: np.ndarray, counts: np.ndarray, max_moves: int, target: float = 1.0
) -> np.ndarray:
    """Improve a placement by up to ``max_moves`` copied experts.

    Two kinds of action: re-purpose one slot (an expert with spare copies gives a slot to an
    expert on the busiest device; one copy moved) or exchange two slots between the busiest
    device and another (two copies moved). The action with the largest drop of the highest
    device load per copy moved is taken, until B <= ``target`` or nothing helps.
    """
    slots = slots.copy()
    num_devices, width = slots.shape
    num_experts = counts.shape[0]
    mean = counts.sum() / num_devices
    budget = max_moves
    while budget > 0:
        k = _device_expert_counts(slots, num_experts)  # copies [R, E]
        reps = k.sum(axis=0)
        per = np.divide(counts, reps, out=np.zeros(num_experts), where=reps > 0)
        dev = k @ per
        m = int(np.argmax(dev))
        top = float(dev[m])
        if top <= target * mean:
            break
        best_gain, best_action = 1e-9 * top, None
        # re-purpose: slot (d, j) holding a (reps[a] >= 2) becomes a copy of b (on m, not on d)
        hot = np.unique(slots[m][slots[m] >= 0])
        a = slots.ravel()
        ok_a = (a >= 0) & (reps[np.where(a >= 0, a, 0)] >= 2)
        if ok_a.any() and hot.size:
            cand = np.flatnonzero(ok_a)
            ca = a[cand]
            d_of = cand // width
            ra = reps[ca]
            up_a = counts[ca] / (ra - 1) - per[ca]  # each remaining copy of a carries more
            # new load [cand, R] from a's change
            base = dev[None, :] + k[:, ca].T * up_a[:, None]
            base[np.arange(cand.size), d_of] -= counts[ca] / (ra - 1)
            for b in hot.tolist():
                if reps[b] >= num_devices:
                    continue
                down_b = counts[b] / (reps[b] + 1) - per[b]
                new = base + (k[:, b] * down_b)[None, :]
                new[np.arange(cand.size), d_of] += counts[b] / (reps[b] + 1)
                valid = (k[d_of, b] == 0) & (ca != b)
                peak = np.where(valid, new.max(axis=1), np.inf)
                i = int(np.argmin(peak))
                gain = top - float(peak[i])
                if gain > best_gain:
                    best_gain, best_action = gain, ("repurpose", int(cand[i]), b)
        # exchange: slot i on m with slot j on d (two copies move)
        if budget >= 2:
            w = np.where(slots >= 0, per[np.where(slots >= 0, slots, 0)], 0.0)
            delta = w[m][:, None, None] - w[None, :, :]
            others = np.sort(dev)[::-1]
            second = others[1] if others.size > 1 else 0.0
            new_peak = np.maximum(np.maximum(top - delta, dev[None, :, None] + delta), second)
            col_m = np.where(slots[m] >= 0, slots[m], 0)
            col = np.where(slots >= 0, slots, 0)
            bad = (delta <= 0) | (k[:, col_m].T[:, :, None] > 0) | (k[m][col][None, :, :] > 0)
            bad[:, m, :] = True
            new_peak = np.where(bad, np.inf, new_peak)
            flat = int(np.argmin(new_peak))
            gain = (top - float(new_peak.flat[flat])) / 2
            if gain > best_gain:
                i, d, j = np.unravel_index(flat, new_peak.shape)
                best_gain, best_action = gain, ("exchange", (m, int(i)), (int(d), int(j)))
        if best_action is None:
            break
        if best_action[0] == "repurpose":
            _, flat_slot, b = best_action
            slots.flat[flat_slot] = b
            budget -= 1
        else:
            _, (m, i), (d, j) = best_action
            slots[m, i], slots[d, j] = slots[d, j], slots[m, i]
            budget -= 2
    return slots


# ---------------------------------------------------------------------------- controller


@dataclass
class DynamicConfig:
    """Knobs of Algorithm 2. Upstream OmniPlacement uses trigger 1.1 and margin 0.05."""

    trigger: float = 1.05
    margin: float = 0.01
    move_cost: float = 0.002  # B a copied expert must buy to be worth moving
    max_moves: int = 8
    predictor: str = "ema-shift"
    predictor_args: dict = field(default_factory=dict)


@dataclass
class StepResult:
    """What the controller decided after one window.

    ``placement`` is the layout for the next window, aligned slot by slot to the previous one so
    that the fewest slots change; ``experts_moved`` counts the slots that receive another
    expert's weights: exactly the copies a live migration makes (0 when nothing was adopted).
    """

    placement: Placement
    experts_moved: int
    predicted_b: np.ndarray
    adopted_layers: list[int]


class DynamicPlanner:
    """Runs Algorithm 2 window by window on a placement it owns."""

    def __init__(self, initial: Placement, config: DynamicConfig | None = None) -> None:
        self.config = config or DynamicConfig()
        self.placement = initial.copy()
        self.predictor = make_predictor(self.config.predictor, **self.config.predictor_args)

    def observe(self, counts: np.ndarray) -> StepResult:
        """Feed one window's counts ``[L, E]``; returns the placement for the next window."""
        cfg = self.config
        self.predictor.update(counts)
        predicted = self.predictor.predict()
        old = self.placement
        new = old.copy()
        adopted: list[int] = []
        before = old.imbalance(predicted)
        for layer in np.flatnonzero(before > cfg.trigger).tolist():
            choice = self._plan_layer(old.slots[layer], predicted[layer], float(before[layer]))
            if choice is not None:
                new.slots[layer] = choice
                adopted.append(layer)
        if not adopted:
            return StepResult(old, 0, before, [])
        self.placement = align(old, new)
        moved = experts_moved(old.slots, self.placement.slots)
        return StepResult(self.placement, moved, before, adopted)

    def _plan_layer(
        self, current: np.ndarray, predicted: np.ndarray, b_now: float
    ) -> np.ndarray | None:
        cfg = self.config
        capacity = (current >= 0).sum(axis=1)
        fresh = align_layer(current, plan_layer(predicted, capacity), predicted.shape[0])
        repaired = repair_layer(current, predicted, cfg.max_moves, target=1.0)
        options = []
        for slots in (repaired, fresh):
            b = layer_imbalance(slots, predicted)
            if b_now - b > cfg.margin:
                options.append((b, experts_moved(current, slots), slots))
        if not options:
            return None
        return min(options, key=lambda o: o[0] + cfg.move_cost * o[1])[2]
