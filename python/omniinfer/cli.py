"""The ``omniinfer`` command: one entry point, one subcommand per tool.

Each tool module listed in SUBCOMMANDS exposes ``add_parser(subparsers)``, which adds its
subcommand and sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from omniinfer import __version__

SUBCOMMANDS: tuple[str, ...] = (
    "omniinfer.bench.cli",
    "omniinfer.placement.cli",
    "omniinfer.emulator.cli",
    "omniinfer.proxy.cli",
    "omniinfer.attn.cli",
    "omniinfer.deploy.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniinfer", description="OmniInfer for SGLang tools")
    parser.add_argument("--version", action="version", version=f"omniinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
