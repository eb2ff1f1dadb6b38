"""``omniinfer router`` / ``python -m omniinfer.router``: flags of sglang_router.launch_router.

Defaults live in ``RouterConfig`` only: the parsed namespace holds just the flags given, so the
``--config`` file (parsed as flags too, entry by entry) fills the rest and never overrides a
flag given on the command line, whatever its value.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from omniinfer.proxy.config import RouterConfig, config_from_args
from omniinfer.proxy.peer_flags import add_peer_flags, split_peer_flags

REPEATED = ("prefill", "decode", "kv-events-endpoint")  # in a file: a list, one entry per use


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The router's flags; a flag not given is absent from the namespace (no argparse default)."""
    p.argument_default = argparse.SUPPRESS
    p.add_argument("--config", help="JSON object of flag values, keyed by flag name (flags given "
                   "on the command line win; an unknown key is an error)")
    w = p.add_argument_group("workers")
    w.add_argument("--host")
    w.add_argument("--port", type=int)
    w.add_argument("--worker-urls", nargs="*", help="regular-mode worker URLs")
    w.add_argument("--pd-disaggregation", action="store_true", help="prefill/decode mode")
    w.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]",
                   help="prefill worker and its bootstrap port (a number, 'none' or omitted)")
    w.add_argument("--decode", nargs=1, action="append", metavar="URL", help="decode worker")
    r = p.add_argument_group("routing")
    r.add_argument("--policy", help="random, round_robin, power_of_two, "
                   "cache_aware or any registered policy (default cache_aware)")
    r.add_argument("--prefill-policy", help="PD: policy for prefill workers")
    r.add_argument("--decode-policy", help="PD: policy for decode workers")
    r.add_argument("--cache-threshold", type=float)
    r.add_argument("--balance-abs-threshold", type=float,
                   help="imbalance gate, in requests' worth of in-flight tokens")
    r.add_argument("--balance-rel-threshold", type=float)
    r.add_argument("--max-tree-size", type=int,
                   help="tokens per worker kept in the prefix index")
    r.add_argument("--apc-block-size", type=int,
                   help="tokens per hashed prefix block")
    r.add_argument("--cache-truth", choices=["router", "kv-events"],
                   help="what fills the prefix index: 'router' (what it routed, LRU) or "
                   "'kv-events' (what each worker reports storing and evicting, over ZMQ; "
                   "workers need SGLang's --kv-events-config)")
    r.add_argument("--kv-events-endpoint", dest="kv_events_endpoints", action="append",
                   metavar="URL=tcp://HOST:PORT",
                   help="a worker's KV-event publisher, if not the one its /server_info names "
                   "(repeat per worker; repeat a worker for its DP ranks, in order)")
    r.add_argument("--dp-aware", action="store_true",
                   help="send each request to one data-parallel rank of its worker "
                   "(routed_dp_rank; in PD also disagg_prefill_dp_rank), the least loaded one "
                   "unless the policy names it; ranks from each worker's /server_info dp_size")
    r.add_argument("--kv-events-max-dp-size", type=int,
                   help="publishers (DP ranks) a worker's /server_info may name")
    r.add_argument("--kv-events-max-pages", type=int,
                   help="pages remembered per publisher; past it that view is reset")
    r.add_argument("--kv-events-max-tokens", type=int,
                   help="tokens of stored pages remembered per worker, over its DP ranks; past "
                   "it the oldest stores are forgotten first (default 1048576; about 65 B a "
                   "token at 16-token pages, 160 B at 1-token pages)")
    r.add_argument("--kv-events-max-message-bytes", type=int,
                   help="largest KV-event message accepted (default 4 MiB); a larger one "
                   "drops that connection, and the router forgets and resubscribes")
    r.add_argument("--oas-ttft-slo-secs", type=float,
                   help="oas: the TTFT objective; waiting requests that can still meet it are "
                   "released before those that no longer can (which the hold bound still "
                   "releases in time). Default: no objective, short-and-old first for all")
    r.add_argument("--oas-lead-fraction", type=float,
                   help="oas: release a held request this fraction of a predicted cycle "
                   "before its instance's next batch boundary (0-1]")
    r.add_argument("--oas-hold-bound-cycles", type=float,
                   help="oas: hold a request at most this many predicted batch cycles "
                   "(default 32; oas_aged uses 8, oas_goodput 32 whatever this says)")
    r.add_argument("--oas-batch-tokens", type=float,
                   help="oas: tokens of one prefill batch assumed until one is measured")
    r.add_argument("--oas-decode-max-running", type=int,
                   help="oas decode: requests running per decode worker before new ones wait "
                   "(0: the worker's reported max_running_requests)")
    r.add_argument("--model-path", help="served model (its tokenizer is used)")
    r.add_argument("--tokenizer-path", help="tokenizer, if not the model's")
    r.add_argument("--default-max-new-tokens", type=int,
                   help="expected output tokens when a request gives no limit")
    q = p.add_argument_group("admission, retries, health")
    q.add_argument("--max-payload-size", type=int, help="largest request body, in bytes")
    q.add_argument("--max-response-size", type=int,
                   help="largest non-streamed worker answer the router buffers, in bytes; "
                   "a larger one is a 502 (streams are not buffered)")
    q.add_argument("--request-timeout-secs", type=float,
                   help="total time of one upstream attempt")
    q.add_argument("--upstream-connect-timeout-secs", type=float)
    q.add_argument("--upstream-first-byte-timeout-secs", type=float,
                   help="streams: time to the first event (queue + prefill)")
    q.add_argument("--upstream-idle-timeout-secs", type=float,
                   help="streams: longest silence between two events")
    q.add_argument("--client-header-timeout-secs", type=float,
                   help="a client's request head must arrive within this")
    q.add_argument("--client-body-timeout-secs", type=float)
    q.add_argument("--client-write-timeout-secs", type=float,
                   help="a client that accepts no byte of its answer for this long is "
                   "disconnected and its request aborted on the worker")
    q.add_argument("--max-connections", type=int,
                   help="open client connections; more are refused with a 503")
    q.add_argument("--tokenize-concurrency", type=int,
                   help="large prompts tokenized at once, off the event loop")
    q.add_argument("--max-concurrent-requests", type=int,
                   help="requests in flight (<= 0: unlimited)")
    q.add_argument("--queue-size", type=int,
                   help="requests waiting for a slot; beyond it: 503 with Retry-After")
    q.add_argument("--queue-timeout-secs", type=float)
    q.add_argument("--retry-max-retries", type=int)
    q.add_argument("--retry-initial-backoff-ms", type=float)
    q.add_argument("--retry-max-backoff-ms", type=float)
    q.add_argument("--retry-backoff-multiplier", type=float)
    q.add_argument("--retry-jitter-factor", type=float)
    q.add_argument("--disable-retries", action="store_true")
    q.add_argument("--health-failure-threshold", type=int)
    q.add_argument("--health-success-threshold", type=int)
    q.add_argument("--health-check-timeout-secs", type=float)
    q.add_argument("--health-check-interval-secs", type=float)
    q.add_argument("--health-check-endpoint")
    q.add_argument("--disable-health-check", action="store_true")
    q.add_argument("--cb-failure-threshold", type=int)
    q.add_argument("--cb-success-threshold", type=int)
    q.add_argument("--cb-timeout-duration-secs", type=float)
    q.add_argument("--disable-circuit-breaker", action="store_true")
    q.add_argument("--loads-poll-interval-secs", "--load-monitor-interval", type=float,
                   dest="loads_poll_interval_secs",
                   help="poll each worker's /v1/loads this often (0: never); "
                   "--load-monitor-interval is smg's name")
    q.add_argument("--load-feed", choices=("auto", "off"),
                   help="auto (default): read the load of a worker that advertises SGLang's "
                   "load feed (--load-publish-endpoint) from it, polling it only while the "
                   "feed is silent; off: poll every worker")
    a = p.add_argument_group("security (as sglang_router)")
    a.add_argument("--api-key",
                   help="sent to workers as 'Authorization: Bearer KEY'; clients must present "
                   "it too (except /health* and /metrics), as SGLang's server requires")
    a.add_argument("--control-plane-api-keys", nargs="*", metavar="ID:NAME:ROLE:KEY",
                   help="named keys, role admin (admin routes and data plane) or user (data "
                   "plane). Without an admin key, /add_worker, /remove_worker and /flush_cache "
                   "answer loopback clients only")
    a.add_argument("--control-plane-audit-enabled", action="store_true",
                   help="log each admin call: key id, role, method, path, outcome")
    a.add_argument("--tls-cert-path", help="serve HTTPS with this PEM certificate (chain)")
    a.add_argument("--tls-key-path", help="... and this PEM private key")
    a.add_argument("--ca-cert-paths", nargs="*", metavar="PEM",
                   help="CA certificates that https:// workers' certificates are checked "
                   "against (besides the system's)")
    a.add_argument("--client-cert-path", help="PEM certificate the router presents to "
                   "https:// workers that ask for one (mutual TLS)")
    a.add_argument("--client-key-path", help="... and its PEM private key")
    w.add_argument("--service-discovery", action="store_true",
                   help="find workers among Kubernetes pods (in-cluster credentials or the "
                   "kubeconfig): Running, Ready pods matching the selectors")
    w.add_argument("--selector", nargs="+", metavar="KEY=VALUE",
                   help="labels of the worker pods (regular mode)")
    w.add_argument("--prefill-selector", nargs="+", metavar="KEY=VALUE",
                   help="labels of the prefill pods (PD mode; bootstrap port from the "
                   "sglang.ai/bootstrap-port annotation)")
    w.add_argument("--decode-selector", nargs="+", metavar="KEY=VALUE",
                   help="labels of the decode pods (PD mode)")
    w.add_argument("--service-discovery-port", type=int,
                   help="the workers' HTTP port in each pod (default 80)")
    w.add_argument("--service-discovery-namespace",
                   help="the namespace to watch (default: every namespace)")
    a.add_argument("--cors-allowed-origins", nargs="*", metavar="ORIGIN",
                   help="answer browsers from these origins (scheme://host[:port], or *) with "
                   "CORS headers; none given: no CORS headers (sglang-router then allows all)")
    q.add_argument("--request-id-headers", nargs="*", metavar="HEADER",
                   help="read a request's id from the first of these headers present (default "
                   "x-request-id x-correlation-id x-trace-id request-id), else make one; it "
                   "comes back as X-Request-Id and goes to the access log")
    q.add_argument("--rate-limit-tokens-per-second", type=float,
                   help="each inference request takes a token from a bucket of "
                   "--max-concurrent-requests tokens (or one second's worth) refilled at this "
                   "rate; without one it waits in the queue's bounds or gets 429")
    o = p.add_argument_group("observability")
    o.add_argument("--access-log", help="JSONL file, one line per request")
    o.add_argument("--access-log-max-bytes", type=int,
                   help="rotate the access log past this size")
    o.add_argument("--access-log-backups", type=int)
    o.add_argument("--prometheus-host", help="also serve /metrics on this host")
    o.add_argument("--prometheus-port", type=int,
                   help="... and this port (default 29000, as sglang-router's; 0: only the "
                   "main port; a default port already taken is skipped with a warning)")
    o.add_argument("--enable-trace", action="store_true",
                   help="one OpenTelemetry span per inference request, exported over OTLP; "
                   "its context goes to the workers as traceparent")
    o.add_argument("--otlp-traces-endpoint",
                   help="the OTLP collector (default localhost:4317, gRPC; with "
                   "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf a URL like "
                   "http://HOST:4318/v1/traces)")
    o.add_argument("--log-level", choices=["debug", "info", "warn", "error"])
    o.add_argument("--log-dir", help="also write the log to LOG_DIR/omniproxy.log")
    o.add_argument("--shutdown-grace-period-secs", type=float,
                   help="on SIGTERM stop accepting and give in-flight requests this long to "
                   "finish, then end each with one error (a stream: an error event and [DONE]; "
                   "default 180; a second signal ends them at once)")
    add_peer_flags(p)


def _words(entry: Any) -> list[str]:
    values = entry if isinstance(entry, list) else [entry]
    if not values or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                             for v in values):
        raise ValueError(f"expected a string, a number or a list of them, got {entry!r}")
    return [str(v) for v in values]


def _as_flags(flag: str, value: Any) -> list[str]:
    """One file entry as the command line would give it (``true``/``false``: a switch)."""
    option = "--" + flag
    if isinstance(value, bool):
        return [option]
    if flag in REPEATED:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, one entry per --{flag}, got {value!r}")
        return [word for entry in value for word in [option, *_words(entry)]]
    if isinstance(value, list):
        return [option, *_words(value)]
    return [f"{option}={_words(value)[0]}"]  # '=': a value may start with '-'


def _is_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    """``--flag`` is one of the parser's options (asked alone it parses, or wants a value)."""
    try:
        return not parser.parse_known_args(["--" + flag])[1]
    except argparse.ArgumentError:
        return True


def read_config_file(path: Path) -> dict[str, Any]:
    """The flags a ``--config`` JSON file sets, typed and checked as the command line's are."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--config {path}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a JSON object of flag values")
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_arguments(parser)
    values: dict[str, Any] = {}
    for key, value in data.items():
        flag = str(key).replace("_", "-")
        if flag == "config":
            raise ValueError(f"--config {path}: a config file cannot name another")
        if not _is_flag(parser, flag):
            raise ValueError(f"--config {path}: unknown key {key!r} (keys are flag names)")
        try:
            parsed, extra = parser.parse_known_args(_as_flags(flag, value))
        except (ValueError, argparse.ArgumentError) as exc:
            raise ValueError(f"--config {path}: {key}: {exc}") from None
        if extra:
            raise ValueError(f"--config {path}: {key}: unexpected {' '.join(extra)!r}")
        if value is not False:  # false: the switch stays off
            values.update(vars(parsed))
    return values


class RefusedFlags(ValueError):
    """Flags of the peer router that OmniProxy does not support; one line each."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


def resolve_with_notes(args: argparse.Namespace) -> tuple[RouterConfig, list[str]]:
    """The config asked for (the flags given, then the ``--config`` file's, then the defaults)
    and a note for each accepted peer flag without effect; ``RefusedFlags`` when any given
    peer flag is refused, ``ValueError`` for any other bad value."""
    given = dict(vars(args))
    path = given.pop("config", None)
    values = {**read_config_file(Path(path)), **given} if path is not None else given
    values, notes, refusals = split_peer_flags(values)
    if refusals:
        raise RefusedFlags(refusals)
    config = config_from_args(argparse.Namespace(**values))
    from omniinfer.proxy.policy_api import available_policies

    known = available_policies()
    for role in ("regular", "prefill", "decode"):
        if config.policy_for(role) not in known:
            raise ValueError(f"unknown policy {config.policy_for(role)!r}; "
                             f"known: {', '.join(known)}")
    return config, notes


def resolve(args: argparse.Namespace) -> RouterConfig:
    return resolve_with_notes(args)[0]


def run(args: argparse.Namespace) -> int:
    try:
        config, notes = resolve_with_notes(args)
    except RefusedFlags as exc:
        for line in exc.lines:
            print(f"omniinfer router: error: {line}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"omniinfer router: error: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"omniinfer router: note: {note}", file=sys.stderr)
    from omniinfer.proxy.server import serve

    return serve(config)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("router", help="OmniProxy: route requests to SGLang workers",
                              description="OmniProxy router (sglang_router.launch_router flags)")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omniinfer.router",
                                     description="OmniProxy router for SGLang workers")
    add_arguments(parser)
    return run(parser.parse_args(sys.argv[1:] if argv is None else argv))
