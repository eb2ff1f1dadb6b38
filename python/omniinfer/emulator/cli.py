"""``omniinfer emulate-worker``: one emulated SGLang worker process."""

from __future__ import annotations

import argparse
import asyncio
import sys

from omniinfer.emulator.profile import ProfileError, load_profile, shipped_profiles
from omniinfer.kv_events import parse_kv_events_config


def _time_scale(value: str) -> float:
    try:
        scale = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if scale < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0.1 = ten times faster than real time)")
    return scale


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "emulate-worker",
        help="serve SGLang's worker protocol with an emulated, calibrated engine (no model, no GPU)",
        description="An emulated SGLang 0.5.23 worker: the same HTTP endpoints, continuous batching, "
        "radix prefix cache and PD pairing, with pass times from a profile's cost model. "
        f"Shipped profiles: {', '.join(shipped_profiles())}.",
    )
    p.add_argument("--profile", required=True, help="shipped profile name or path to a YAML profile")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="prefill mode: where the emulated KV bootstrap endpoint listens")
    p.add_argument("--time-scale", type=_time_scale, default=1.0,
                   help="wall seconds per model second (0.1 = ten times faster than real time)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="override the profile's KV pool")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams only new tokens per event (SGLang's flag of that name)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the radix cache's KV events over ZMQ as SGLang does, e.g. "
                   '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}\'')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.max_total_tokens is not None:
        if args.max_total_tokens < 1:
            print("error: --max-total-tokens must be >= 1", file=sys.stderr)
            return 2
        profile = profile.with_capacity(max_total_tokens=args.max_total_tokens)
    if args.kv_events_config is not None:
        try:
            parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            print(f"error: --kv-events-config: {exc}", file=sys.stderr)
            return 2
    from omniinfer.emulator.server import WorkerServer, serve_forever

    server = WorkerServer(
        profile, args.port, host=args.host, mode=args.disaggregation_mode,
        bootstrap_port=args.disaggregation_bootstrap_port, time_scale=args.time_scale,
        incremental_streaming_output=args.incremental_streaming_output,
        kv_events_config=args.kv_events_config,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a runtime dependency
        runner = asyncio.run
    try:
        runner(serve_forever(server))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        print(f"error: cannot serve on port {args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
