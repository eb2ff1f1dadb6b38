"""Omni flags on the stock launcher: added to the parser, validated, exported to workers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from omniinfer.flags import OmniConfig, OmniFlagError, add_arguments

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"


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
    except OmniFlagError as exc:
        # One line, no traceback: the launch stops here before any process is started.
        print(f"omniinfer: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    config.export()
    return None


def register() -> None:
    HookRegistry.register(ADD_CLI_ARGS, _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _before_from_cli_args, HookType.BEFORE)
