"""Omni flags on the stock launcher: added to the parser, validated, exported to workers."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from omniinfer.flags import OmniConfig, OmniFlagError, add_arguments
from omniinfer.sglang_plugin import hooks, targets
from omniinfer.sglang_plugin.http_routes import STATE_DIR_ENV


def _after_add_cli_args(_result: Any, parser: argparse.ArgumentParser, *_a: Any, **_k: Any) -> None:
    add_arguments(parser)


def _before_from_cli_args(*args: Any, **kwargs: Any) -> None:
    namespace = kwargs.get("args")
    if namespace is None:
        namespace = next((a for a in args if isinstance(a, argparse.Namespace)), None)
    if namespace is None:
        return None
    try:
        config = OmniConfig.from_namespace(namespace)
        _check_surface(config)
        if config.enable_omni_placement:
            _prepare_placement(namespace, config)
        if config.omni_attn_pattern is not None:
            from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

            prepare_namespace(namespace, config)
        _cpu_defaults(namespace, config)
    except OmniFlagError as exc:
        # One line, no traceback: the launch stops here before any process is started.
        print(f"omniinfer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    config.export()
    if not os.environ.get(STATE_DIR_ENV):
        os.environ[STATE_DIR_ENV] = tempfile.mkdtemp(prefix="omniinfer-state-")
    from omniinfer.sglang_plugin.http_routes import register_routes

    register_routes()
    return None


def _check_surface(config: OmniConfig) -> None:
    """The ServerArgs fields the switched-on features read or write on the namespace and the
    environment variables they set or name (``internals.check_launch``), checked against the
    installed SGLang before any is touched: a renamed field would be dropped when written and
    read as its default, so a refusal would silently pass."""
    from omniinfer.cpu.detect import cpu_engine_active
    from omniinfer.sglang_plugin import internals

    features = internals.start_up_features(
        placement=config.enable_omni_placement, omni_attn=config.omni_attn_pattern is not None,
        cpu_engine=cpu_engine_active())
    try:
        internals.check_launch(features)
    except internals.SGLangInternalsError as exc:
        raise OmniFlagError(str(exc).replace("\n", " ")) from None


def _cpu_defaults(namespace: argparse.Namespace, config: OmniConfig) -> None:
    from omniinfer.cpu.detect import cpu_engine_active

    if not cpu_engine_active():
        return
    from omniinfer.cpu.server_defaults import apply_cpu_server_defaults

    for change in apply_cpu_server_defaults(namespace, busy_poll=config.omni_cpu_busy_poll):
        print(f"omniinfer: CPU engine default: {change}", file=sys.stderr)


def _prepare_placement(namespace: argparse.Namespace, config: OmniConfig) -> None:
    """OmniPlacement runs on SGLang's EPLB plumbing (recorder, expert map) with its own decisions."""
    ep_size = getattr(namespace, "ep_size", None) or 1
    if ep_size <= 1:
        raise OmniFlagError("--enable-omni-placement: needs expert parallelism (--ep-size > 1)")
    namespace.enable_eplb = True
    if config.omni_placement_plan is not None:
        namespace.init_expert_location = config.omni_placement_plan


def register() -> None:
    hooks.register(targets.ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    hooks.register(targets.FROM_CLI_ARGS, _before_from_cli_args, HookType.BEFORE)
