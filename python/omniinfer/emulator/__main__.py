"""``python -m omniinfer.emulator --profile P --port N ...``: the same as ``omniinfer emulate-worker``."""

from __future__ import annotations

import argparse
import sys

from omniinfer.emulator.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omniinfer.emulator")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["emulate-worker", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
