"""Expert-load model: read counts from SGLang dumps, JSON or CSV, check them, and window them.

SGLang's expert-distribution recorder dumps ``logical_count [steps, layers, experts]``; the planner
wants ``[layers, experts]``. Steps are folded either by a plain sum (what SGLang's EPLB does), a
sliding window over the last steps, or an exponential moving average, so recent load weighs more.
"""

from __future__ import annotations

import csv
import json
from collections import deque
from importlib import resources
from pathlib import Path

import numpy as np

from omniinfer.placement.layout import PlacementError


class CountsError(PlacementError):
    """Expert counts that cannot be planned on."""


def validate_counts(counts: np.ndarray, num_experts: int | None = None) -> np.ndarray:
    """Return ``counts`` as float ``[L, E]`` or raise one clear :class:`CountsError`."""
    arr = np.asarray(counts, dtype=float)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise CountsError(
            f"expert counts must be a non-empty [layers, experts] matrix, got {arr.shape}"
        )
    if num_experts is not None and arr.shape[1] != num_experts:
        raise CountsError(f"expert counts have {arr.shape[1]} experts, expected {num_experts}")
    if not np.isfinite(arr).all():
        raise CountsError("expert counts contain NaN or infinite values")
    if (arr < 0).any():
        layer, expert = map(int, np.argwhere(arr < 0)[0])
        raise CountsError(f"expert counts are negative (layer {layer}, expert {expert})")
    zero = np.flatnonzero(arr.sum(axis=1) == 0)
    if zero.size:
        raise CountsError(f"layer {int(zero[0])} has no routed tokens (all counts are zero)")
    return arr


def _as_steps(obj: object, source: str) -> np.ndarray:
    """Turn a loaded object into ``[steps, L, E]`` floats."""
    if isinstance(obj, dict):
        if "logical_count" not in obj:
            raise CountsError(f"{source}: no 'logical_count' key (keys: {sorted(obj)})")
        obj = obj["logical_count"]
    if hasattr(obj, "detach"):  # a torch tensor, without importing torch here
        obj = obj.detach().cpu().double().numpy()
    try:
        arr = np.asarray(obj, dtype=float)
    except (TypeError, ValueError) as exc:
        raise CountsError(f"{source}: logical_count is not a numeric array ({exc})") from None
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise CountsError(
            f"{source}: logical_count must be [layers, experts] or [steps, layers, experts], "
            f"got shape {arr.shape}"
        )
    return arr


def read_count_steps(path: str | Path) -> np.ndarray:
    """Read ``[steps, L, E]`` counts from an SGLang ``.pt`` dump, a JSON file or a CSV matrix."""
    path = Path(path)
    if not path.is_file():
        raise CountsError(f"counts file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".pt":
        import torch

        obj = torch.load(path, map_location="cpu", weights_only=True)
    elif suffix == ".json":
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CountsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    elif suffix == ".csv":
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if r and not r[0].lstrip().startswith("#")]
        try:
            obj = [[float(x) for x in r] for r in rows]
        except ValueError as exc:
            raise CountsError(f"{path}: CSV must hold numbers only ({exc})") from None
        if len({len(r) for r in rows}) > 1:
            raise CountsError(f"{path}: CSV rows have different lengths")
    else:
        raise CountsError(f"{path}: unknown counts format (use .pt, .json or .csv)")
    return _as_steps(obj, str(path))


def fold_steps(
    steps: np.ndarray, mode: str = "sum", window: int = 0, alpha: float = 0.3
) -> np.ndarray:
    """Fold ``[steps, L, E]`` into ``[L, E]``: ``sum``, ``window`` (last N steps) or ``ema``."""
    if mode == "sum":
        return steps.sum(axis=0)
    if mode == "window":
        if window <= 0:
            raise CountsError("a sliding window needs --window > 0")
        return SlidingWindow(window).extend(steps).total()
    if mode == "ema":
        ema = EmaWindow(alpha)
        for step in steps:
            ema.update(step)
        return ema.value()
    raise CountsError(f"unknown fold mode {mode!r} (sum, window, ema)")


def load_counts(
    path: str | Path, mode: str = "sum", window: int = 0, alpha: float = 0.3
) -> np.ndarray:
    """Read, fold and validate: the ``[L, E]`` counts the planner works on."""
    return validate_counts(fold_steps(read_count_steps(path), mode, window, alpha))


class SlidingWindow:
    """Sum of the last ``size`` steps; older steps drop out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._steps: deque[np.ndarray] = deque(maxlen=size)

    def update(self, counts: np.ndarray) -> None:
        self._steps.append(np.asarray(counts, dtype=float))

    def extend(self, steps: np.ndarray) -> SlidingWindow:
        for step in steps:
            self.update(step)
        return self

    def total(self) -> np.ndarray:
        if not self._steps:
            raise CountsError("the sliding window is empty")
        return np.sum(self._steps, axis=0)


class EmaWindow:
    """Exponential moving average of per-step counts (weight ``alpha`` on the newest step)."""

    def __init__(self, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise CountsError(f"EMA alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._value: np.ndarray | None = None

    def update(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts, dtype=float)
        if self._value is None:
            self._value = counts.copy()
        else:
            self._value = self.alpha * counts + (1 - self.alpha) * self._value

    def value(self) -> np.ndarray:
        if self._value is None:
            raise CountsError("the moving average has seen no steps")
        return self._value


DEFAULT_DOMAIN_COUNTS = "olmoe/expert_counts.json"


def read_domain_counts(
    path: str | Path | None = None, model: str = "olmoe"
) -> dict[str, np.ndarray]:
    """Per-domain ``[L, E]`` counts of one model from the OLMoE routing-statistics JSON.

    ``path=None`` reads the copy shipped in ``omniinfer/data/moe``.
    """
    if path is None:
        text = resources.files("omniinfer.data").joinpath("moe", DEFAULT_DOMAIN_COUNTS).read_text()
        source = f"packaged {DEFAULT_DOMAIN_COUNTS}"
    else:
        if not Path(path).is_file():
            raise CountsError(f"counts file not found: {path}")
        text, source = Path(path).read_text(), str(path)
    data = json.loads(text)
    models = data.get("data", {}) if isinstance(data, dict) else {}
    if model not in models:
        raise CountsError(
            f"{source}: no model {model!r} (have: {', '.join(sorted(models)) or 'none'})"
        )
    domains = models[model].get("expert_counts", {})
    out = {
        name: validate_counts(np.asarray(d["counts"], float)) for name, d in sorted(domains.items())
    }
    if not out:
        raise CountsError(f"{source}: model {model!r} has no per-domain expert_counts")
    return out
