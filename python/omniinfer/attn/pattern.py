"""OmniAttn pattern files: which layers keep only their sink and recent tokens.

A pattern is what the search hands to the serving runtime, so the file carries everything the
runtime must check before trusting it: the model it was searched on (id plus the shape facts
that make a pattern meaningless on another model), the window sizes, the compressed layer ids,
and how it was found. Loading validates the file against a model config and reports every
mismatch, one line each, in a single :class:`PatternError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "omniinfer.attn.pattern"
VERSION = 1
# Model config fields a pattern depends on: layer count (ids), KV shape (memory figures).
SHAPE_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


class PatternError(ValueError):
    """A pattern file that is malformed or does not fit the model; ``problems`` lists each."""

    def __init__(self, problems: list[str], source: str = "pattern") -> None:
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


@dataclass(frozen=True)
class Pattern:
    """Compressed layers keep KV of tokens [0, sink) and the last ``recent`` tokens only."""

    model_id: str
    num_layers: int
    sink: int
    recent: int
    compressed_layers: tuple[int, ...]
    model_shape: Mapping[str, int] = field(default_factory=dict)
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = _check_values(
            self.num_layers, self.sink, self.recent, list(self.compressed_layers)
        )
        if problems:
            raise PatternError(problems)
        object.__setattr__(self, "compressed_layers", tuple(sorted(self.compressed_layers)))

    @property
    def mask(self) -> tuple[bool, ...]:
        """Per-layer flags: True where the layer is compressed."""
        chosen = set(self.compressed_layers)
        return tuple(i in chosen for i in range(self.num_layers))

    def window(self, layer: int) -> tuple[int, int] | None:
        """(sink, recent) for a compressed layer, None for a full one."""
        return (self.sink, self.recent) if layer in self.compressed_layers else None

    def kv_saved_fraction(self, context: int) -> float:
        """Share of the whole model's KV memory freed for one sequence of ``context`` tokens.

        Every layer has the same KV width here (Llama/Qwen style), so bytes cancel out.
        """
        return kv_saved_fraction(
            len(self.compressed_layers), self.num_layers, self.sink, self.recent, context
        )

    @property
    def serving_context(self) -> int | None:
        """The request length the pattern was searched for (its provenance's ``context``), the
        length a server balances its two KV pools for; None when the file does not say."""
        context = self.provenance.get("context")
        return context if _is_int(context) and context > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": {"id": self.model_id, "num_layers": self.num_layers, **self.model_shape},
            "sink": self.sink,
            "recent": self.recent,
            "compressed_layers": list(self.compressed_layers),
            "provenance": dict(self.provenance),
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def kv_saved_fraction(compressed: int, layers: int, sink: int, recent: int, context: int) -> float:
    """KV share freed when ``compressed`` of ``layers`` equal layers keep sink + recent tokens."""
    if context <= 0:
        raise ValueError("context must be positive")
    kept = min(context, sink + recent)
    return compressed * (context - kept) / (layers * context)


def _check_values(num_layers: Any, sink: Any, recent: Any, layers: Any) -> list[str]:
    problems: list[str] = []
    if not _is_int(num_layers) or num_layers < 1:
        problems.append(f"model.num_layers must be a positive integer, got {num_layers!r}")
    if not _is_int(sink) or sink < 0:
        problems.append(f"sink must be an integer >= 0, got {sink!r}")
    if not _is_int(recent) or recent < 1:
        problems.append(f"recent must be an integer >= 1, got {recent!r}")
    if not isinstance(layers, list) or not all(_is_int(i) for i in layers):
        problems.append(f"compressed_layers must be a list of integers, got {layers!r}")
        return problems
    if len(set(layers)) != len(layers):
        problems.append(f"compressed_layers has duplicates: {sorted(layers)}")
    if _is_int(num_layers):
        outside = sorted(i for i in layers if not 0 <= i < num_layers)
        if outside:
            problems.append(f"compressed_layers {outside} outside 0..{num_layers - 1}")
    return problems


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(data: Any, source: str = "pattern") -> Pattern:
    """Build a Pattern from decoded JSON, collecting every schema problem."""
    if not isinstance(data, dict):
        raise PatternError([f"expected a JSON object, got {type(data).__name__}"], source)
    problems: list[str] = []
    if data.get("format") != FORMAT:
        problems.append(f"format must be {FORMAT!r}, got {data.get('format')!r}")
    if data.get("version") != VERSION:
        problems.append(f"version must be {VERSION}, got {data.get('version')!r}")
    missing = [k for k in ("model", "sink", "recent", "compressed_layers") if k not in data]
    problems += [f"missing key {k!r}" for k in missing]
    model = data.get("model", {})
    if not isinstance(model, dict):
        model = {}
    if not isinstance(model.get("id"), str):
        problems.append("model must be an object with a string 'id'")
    if not missing:
        problems += _check_values(
            model.get("num_layers"), data["sink"], data["recent"], data["compressed_layers"]
        )
    provenance = data.get("provenance", {})
    if not isinstance(provenance, dict):
        problems.append("provenance must be an object")
    if problems:
        raise PatternError(problems, source)
    shape = {k: int(v) for k, v in model.items() if k in SHAPE_FIELDS[1:] and _is_int(v)}
    return Pattern(
        model_id=model["id"],
        num_layers=model["num_layers"],
        sink=data["sink"],
        recent=data["recent"],
        compressed_layers=tuple(data["compressed_layers"]),
        model_shape=shape,
        provenance=provenance,
    )


def model_shape(config: Any) -> dict[str, int]:
    """The SHAPE_FIELDS of a transformers config (or a mapping), as a pattern stores them."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    shape = {k: get(k) for k in SHAPE_FIELDS}
    if shape["num_key_value_heads"] is None:
        shape["num_key_value_heads"] = get("num_attention_heads")
    if shape["head_dim"] is None and get("hidden_size") and get("num_attention_heads"):
        shape["head_dim"] = get("hidden_size") // get("num_attention_heads")
    return {k: int(v) for k, v in shape.items() if v is not None}


def check_model(pattern: Pattern, config: Any, model_id: str | None = None) -> list[str]:
    """Every way ``pattern`` does not fit a model with ``config`` (empty when it fits)."""
    shape = model_shape(config)
    problems: list[str] = []
    if model_id is not None and _base_name(model_id) != _base_name(pattern.model_id):
        problems.append(f"searched on model {pattern.model_id!r}, not {model_id!r}")
    layers = shape.get("num_hidden_layers")
    if layers != pattern.num_layers:
        problems.append(f"pattern has {pattern.num_layers} layers, model has {layers}")
    for key, value in pattern.model_shape.items():
        if key in shape and shape[key] != value:
            problems.append(f"pattern {key} is {value}, model {key} is {shape[key]}")
    return problems


def _base_name(model_id: str) -> str:
    """'HuggingFaceTB/SmolLM2-135M-Instruct' and '.cache/models/SmolLM2-135M-Instruct' match."""
    return Path(model_id.rstrip("/")).name.lower()


def load(
    path: Path, config: Any | None = None, model_id: str | None = None
) -> Pattern:
    """Read and validate a pattern file; with ``config``, also against that model."""
    source = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PatternError([f"cannot read: {exc.strerror or exc}"], source) from exc
    except json.JSONDecodeError as exc:
        raise PatternError([f"not valid JSON: {exc}"], source) from exc
    pattern = parse(data, source)
    if config is not None:
        problems = check_model(pattern, config, model_id)
        if problems:
            raise PatternError(problems, source)
    return pattern


def from_layers(
    layers: Iterable[int],
    config: Any,
    sink: int,
    recent: int,
    model_id: str,
    provenance: Mapping[str, Any] | None = None,
) -> Pattern:
    """A pattern for the model described by ``config``."""
    shape = model_shape(config)
    return Pattern(
        model_id=model_id,
        num_layers=shape["num_hidden_layers"],
        sink=sink,
        recent=recent,
        compressed_layers=tuple(layers),
        model_shape={k: v for k, v in shape.items() if k != "num_hidden_layers"},
        provenance=dict(provenance or {}),
    )
