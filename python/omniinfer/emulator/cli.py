"""``omniinfer emulate-worker``: one emulated SGLang worker process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from omniinfer.emulator.faults import FaultError, Faults
from omniinfer.emulator.profile import Profile, ProfileError, load_profile, shipped_profiles
from omniinfer.emulator.sparse import MOE_MODELS, PLACEMENTS, AttnPattern, MoeConfig
from omniinfer.kv_event_wire import parse_kv_events_config
from omniinfer.load_feed_wire import DECODE_PUBLISH_INTERVAL, resolve_load_endpoint

# --moe-<field> and --attn-<field> flags: each overrides the profile's moe / attn_pattern value
MOE_HELP = {
    "share": "part of each pass spent in MoE layers, [0, 1]: pass = (1-share)·t + share·t·B/b_ref "
             "(0: no MoE term)",
    "placement": "who places the experts: none (contiguous), static (planned once), eplb (SGLang's "
                 "EPLB every --moe-eplb-period windows, stalls while weights move), omni (dynamic "
                 "controller, migrates in the background), oracle (a floor)",
    "model": "whose real router counts drive the load (olmoe: 64 experts top-8, mistral: 8 top-2)",
    "ranks": "expert-parallel devices",
    "redundant": "redundant expert slots per layer (ignored by none)",
    "skew": "routing unevenness: each expert share p becomes p^skew renormalised (1: as recorded, "
            "0: uniform)",
    "window-steps": "forward passes per window of the drifting load",
    "eplb-period": "windows between two EPLB rebalances",
    "b-ref": "the imbalance the profile's pass times were measured at (1: balanced)",
    "expert-bytes": "bytes of one expert's weights in one layer (0: the model's bf16 size)",
    "layers": "MoE layers of the served model, whose experts all migrate (0: the counts model's)",
    "migration-gb-s": "bandwidth expert weights move at, GB/s",
    "seed": "seed of the drifting load",
}
ATTN_HELP = {
    "compressed-fraction": "share of layers keeping only sink + recent KV (0: no pattern)",
    "sink": "first tokens a compressed layer keeps",
    "recent": "last tokens a compressed layer keeps",
}


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
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate")
    p.add_argument("--ssl-keyfile", default=None, help="... and this PEM key")
    p.add_argument("--ssl-ca-certs", default=None, help="require client certificates signed by "
                   "these CAs (mutual TLS; SGLang only checks them when a client offers one)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="/generate streams only new tokens per event (SGLang's flag of that name)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the radix cache's KV events over ZMQ as SGLang does, e.g. "
                   '\'{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}\'')
    p.add_argument("--load-publish-endpoint", default=None, metavar="auto|off|tcp://*:PORT",
                   help="publish the runtime load on a ZMQ PUB socket as SGLang does (needs "
                   "--kv-events-config; auto: the port after the KV-event port), advertised in "
                   "/server_info's kv_events block")
    p.add_argument("--load-snapshot-publish-interval", type=int, default=DECODE_PUBLISH_INTERVAL,
                   metavar="N", help="with --load-publish-endpoint: publish after every Nth "
                   "decode pass (every prefill pass publishes)")
    p.add_argument("--request-log-size", type=int, default=256, metavar="N",
                   help="generation requests and aborts kept for GET /emulator/requests (0: none)")
    f = p.add_argument_group("faults", "switched at run time with POST /emulator/faults (JSON of "
                             "the same names without --fault-); DELETE /emulator/faults turns all off")
    f.add_argument("--fault-fail-status", type=int, default=0, metavar="STATUS",
                   help="answer every generation request with this HTTP status (0: off)")
    f.add_argument("--fault-hang-after-tokens", type=int, default=-1, metavar="N",
                   help="requests stop making progress after N output tokens (0: never answered) "
                   "until aborted or their client leaves (-1: off)")
    f.add_argument("--fault-disconnect-after-tokens", type=int, default=-1, metavar="N",
                   help="close a request's connection once it has N output tokens (-1: off)")
    f.add_argument("--fault-exit-after-tokens", type=int, default=-1, metavar="N",
                   help="exit the process, as a crash, once a request has N output tokens (-1: off)")
    f.add_argument("--fault-first-byte-delay-s", type=float, default=0.0, metavar="S",
                   help="hold each answer's first byte back S seconds; the work is not delayed")
    s = p.add_argument_group("sparse techniques", "MoE expert imbalance and attention patterns; "
                             "each flag overrides the profile's moe / attn_pattern value (off by default)")
    for prefix, cls, helps in (("moe", MoeConfig, MOE_HELP), ("attn", AttnPattern, ATTN_HELP)):
        for field in dataclasses.fields(cls):
            name = field.name.replace("_", "-")
            kind = type(field.default)
            choices = {"placement": PLACEMENTS, "model": tuple(MOE_MODELS)}.get(field.name)
            s.add_argument(f"--{prefix}-{name}", type=kind, default=None, choices=choices,
                           metavar=None if choices else ("N" if kind is int else "X"),
                           help=f"{helps[name]} (default: the profile's, else {field.default})")
    p.set_defaults(func=run)


def sparse_from_args(args: argparse.Namespace, profile: Profile) -> Profile:
    """``profile`` with the ``--moe-*`` / ``--attn-*`` flags given applied; ValueError names a bad one."""
    out: dict[str, Any] = {}
    for prefix, current in (("moe", profile.moe), ("attn", profile.attn_pattern)):
        given = {f.name: getattr(args, f"{prefix}_{f.name}", None) for f in dataclasses.fields(current)}
        given = {k: v for k, v in given.items() if v is not None}
        try:
            out[prefix] = dataclasses.replace(current, **given)
        except ValueError as exc:
            raise ValueError(f"--{prefix}-*: {exc}") from None
    return profile.with_sparse(moe=out["moe"], attn_pattern=out["attn"])


def faults_from_args(args: argparse.Namespace) -> Faults:
    """The ``--fault-*`` flags as fault switches; FaultError names a bad one."""
    faults = Faults()
    for name in faults.as_dict():
        try:
            faults.update({name: getattr(args, f"fault_{name}")})
        except FaultError as exc:
            raise FaultError(f"--fault-{name.replace('_', '-')}: {exc}") from None
    return faults


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
    try:
        profile = sparse_from_args(args, profile)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.kv_events_config is not None:
        try:
            parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            print(f"error: --kv-events-config: {exc}", file=sys.stderr)
            return 2
    try:
        resolve_load_endpoint(args.load_publish_endpoint,
                              parse_kv_events_config(args.kv_events_config)
                              if args.kv_events_config else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.load_snapshot_publish_interval < 1:
        print("error: --load-snapshot-publish-interval must be >= 1", file=sys.stderr)
        return 2
    if args.request_log_size < 0:
        print("error: --request-log-size must be >= 0", file=sys.stderr)
        return 2
    try:
        faults = faults_from_args(args)
    except FaultError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from omniinfer.emulator.server import WorkerServer, serve_forever
    from omniinfer.emulator.tls import tls_context

    try:  # the MoE clock plans its first placement here (a PlacementError is a ValueError)
        server = WorkerServer(
            profile, args.port, host=args.host, mode=args.disaggregation_mode,
            bootstrap_port=args.disaggregation_bootstrap_port, time_scale=args.time_scale,
            incremental_streaming_output=args.incremental_streaming_output,
            kv_events_config=args.kv_events_config,
            load_publish_endpoint=args.load_publish_endpoint,
            load_snapshot_publish_interval=args.load_snapshot_publish_interval, faults=faults,
            request_log_size=args.request_log_size,
            ssl_context=tls_context(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
