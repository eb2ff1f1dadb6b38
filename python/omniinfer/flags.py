"""The omni launch flags: one table that defines them, validates them and carries them.

SGLang's ServerArgs keeps only its own fields, so the omni values travel from the launcher to
the scheduler, detokenizer and DP-controller processes in one environment variable that every
child process inherits. This module is pure Python: it does not import SGLang.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV_VAR = "OMNIINFER_CONFIG"


class OmniFlagError(ValueError):
    """A bad omni flag value; its message is one line meant for the user."""


def _existing_json_file(flag: str, value: Any) -> None:
    path = Path(value)
    if not path.is_file():
        raise OmniFlagError(f"{flag}: no such file: {value}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise OmniFlagError(f"{flag}: cannot read {value}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise OmniFlagError(f"{flag}: {value} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise OmniFlagError(f"{flag}: {value} must hold a JSON object")


def _known_predictor(flag: str, value: Any) -> None:
    from omniinfer.placement.dynamic import PREDICTORS  # the planner's registry (NumPy only)

    if value not in PREDICTORS:
        raise OmniFlagError(f"{flag}: unknown predictor {value!r} (one of "
                            f"{', '.join(sorted(PREDICTORS))})")


def _at_least(bound: float, inclusive: bool = True) -> Callable[[str, Any], None]:
    def check(flag: str, value: Any) -> None:
        ok = value >= bound if inclusive else value > bound
        if not ok:
            relation = ">=" if inclusive else ">"
            raise OmniFlagError(f"{flag}: must be {relation} {bound}, got {value}")

    return check


@dataclasses.dataclass(frozen=True)
class OmniFlag:
    """One command-line flag of the plugin."""

    name: str  # the dest, e.g. "omni_attn_pattern"
    type: type
    default: Any
    help: str
    check: Callable[[str, Any], None] | None = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


OMNI_FLAGS: tuple[OmniFlag, ...] = (
    OmniFlag(
        "enable_omni_placement",
        bool,
        False,
        "OmniPlacement: load-aware expert redundancy with asynchronous monitoring and "
        "non-blocking weight migration (needs expert parallelism, --ep-size > 1).",
    ),
    OmniFlag(
        "omni_placement_trigger",
        float,
        1.05,
        "OmniPlacement: re-plan a layer when its imbalance max/mean device load exceeds this.",
        _at_least(1.0),
    ),
    OmniFlag(
        "omni_placement_margin",
        float,
        0.01,
        "OmniPlacement: adopt a new layout only if it lowers the imbalance by more than this.",
        _at_least(0.0),
    ),
    OmniFlag(
        "omni_placement_predictor",
        str,
        "ema-shift",
        "OmniPlacement: how the next window's activations are predicted (ema-shift: a damped "
        "trend that restarts on a regime shift; also ema, ema-trend, window, last).",
        _known_predictor,
    ),
    OmniFlag(
        "omni_placement_window",
        int,
        None,
        "OmniPlacement: span N of the predictor's moving average (ema, ema-trend, ema-shift: "
        "weight 2/(N+1) on the newest window; window: the mean of the last N windows; last "
        "has none; at most 1000); default: the predictor's own (0.3 on the newest window, 10 "
        "windows).",
        _at_least(1),
    ),
    OmniFlag(
        "omni_placement_interval",
        int,
        100,
        "OmniPlacement: forward passes between two placement decisions.",
        _at_least(1),
    ),
    OmniFlag(
        "omni_placement_plan",
        str,
        None,
        "OmniPlacement: JSON plan file (from `omniinfer placement plan`) for the initial layout.",
        _existing_json_file,
    ),
    OmniFlag(
        "omni_attn_pattern",
        str,
        None,
        "OmniAttn: JSON pattern file (from `omniinfer attn search`) naming the layers whose KV "
        "keeps only sink and recent tokens.",
        _existing_json_file,
    ),
    OmniFlag(
        "omni_attn_context",
        int,
        None,
        "OmniAttn: the request length (prompt + output tokens) the full and compressed KV pools "
        "are sized for (exactly with --max-total-tokens, with a fixed headroom without it); "
        "default: the context the pattern was searched for (its file says), else 2048.",
        _at_least(1),
    ),
    OmniFlag(
        "omni_cpu_busy_poll",
        bool,
        False,
        "CPU engine: keep SGLang's busy-polling scheduler (by default the plugin passes "
        "--sleep-on-idle there, since an idle scheduler otherwise takes a whole core).",
    ),
)

FLAGS_BY_NAME: dict[str, OmniFlag] = {f.name: f for f in OMNI_FLAGS}


@dataclasses.dataclass(frozen=True)
class OmniConfig:
    """The omni values of one server, as every SGLang process sees them."""

    enable_omni_placement: bool = False
    # the planner settings docs/benchmarks.md measured (placement.dynamic.DynamicConfig)
    omni_placement_trigger: float = 1.05
    omni_placement_margin: float = 0.01
    omni_placement_predictor: str = "ema-shift"
    omni_placement_window: int | None = None
    omni_placement_interval: int = 100
    omni_placement_plan: str | None = None
    omni_attn_pattern: str | None = None
    omni_attn_context: int | None = None
    omni_cpu_busy_poll: bool = False

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> OmniConfig:
        """Build and validate a config; unknown keys are an error, missing ones take defaults."""
        unknown = sorted(set(values) - set(FLAGS_BY_NAME))
        if unknown:
            raise OmniFlagError(f"unknown omni setting(s): {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            flag = FLAGS_BY_NAME[name]
            if value is None:
                kwargs[name] = None
                continue
            if flag.type is bool:
                if not isinstance(value, bool):
                    raise OmniFlagError(f"{flag.option}: expected true or false, got {value!r}")
            elif flag.type in (int, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise OmniFlagError(f"{flag.option}: expected a number, got {value!r}")
                if flag.type is int and value != int(value):
                    raise OmniFlagError(f"{flag.option}: expected an integer, got {value!r}")
                value = flag.type(value)
            elif not isinstance(value, str):
                raise OmniFlagError(f"{flag.option}: expected a string, got {value!r}")
            if flag.check is not None:
                flag.check(flag.option, value)
            kwargs[name] = value
        config = cls(**kwargs)
        config._check_combination()
        return config

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> OmniConfig:
        return cls.from_mapping({n: getattr(args, n) for n in FLAGS_BY_NAME if hasattr(args, n)})

    def _check_combination(self) -> None:
        if self.omni_placement_plan is not None and not self.enable_omni_placement:
            raise OmniFlagError("--omni-placement-plan: needs --enable-omni-placement")
        if self.omni_attn_context is not None and self.omni_attn_pattern is None:
            raise OmniFlagError("--omni-attn-context: needs --omni-attn-pattern")
        if self.omni_placement_window is not None:
            from omniinfer.placement.dynamic import window_args  # NumPy only
            from omniinfer.placement.layout import PlacementError

            try:
                window_args(self.omni_placement_predictor, self.omni_placement_window)
            except PlacementError as exc:
                raise OmniFlagError(f"--omni-placement-window: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def non_default(self) -> dict[str, Any]:
        """The values a user set, for logs and status endpoints."""
        default = OmniConfig()
        return {
            k: v for k, v in dataclasses.asdict(self).items() if getattr(default, k) != v
        }

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Publish the config to child processes through the environment."""
        target = os.environ if environ is None else environ
        target[ENV_VAR] = self.to_json()


def current_config(environ: Mapping[str, str] | None = None) -> OmniConfig:
    """The config this process was launched with (defaults when none was exported)."""
    source = os.environ if environ is None else environ
    raw = source.get(ENV_VAR)
    if not raw:
        return OmniConfig()
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise OmniFlagError(f"{ENV_VAR} is not valid JSON: {exc.msg}") from None
    if not isinstance(values, dict):
        raise OmniFlagError(f"{ENV_VAR} must hold a JSON object")
    return OmniConfig.from_mapping(values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the omni flags to an argparse parser as one titled group.

    Values are parsed loosely here (strings become numbers) and validated by OmniConfig, so a
    bad value produces one error line of ours instead of argparse's usage dump.
    """
    group = parser.add_argument_group(
        "OmniInfer", "Flags added by the omniinfer plugin (OmniPlacement, OmniAttn)."
    )
    for flag in OMNI_FLAGS:
        if flag.type is bool:
            group.add_argument(flag.option, dest=flag.name, action="store_true", help=flag.help)
        else:
            group.add_argument(
                flag.option,
                dest=flag.name,
                type=_lenient(flag),
                default=flag.default,
                metavar=flag.type.__name__.upper() if flag.type is not str else "FILE",
                help=f"{flag.help} (default: {flag.default})",
            )


class _Unparsable(str):
    """A value argparse could not convert; OmniConfig reports it in one line."""


def _lenient(flag: OmniFlag) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if flag.type is str:
            return text
        try:
            return flag.type(text)
        except ValueError:
            return _Unparsable(text)

    convert.__name__ = flag.type.__name__
    return convert
