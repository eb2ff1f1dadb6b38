"""``omniinfer router`` / ``python -m omniinfer.router``: flags of sglang_router.launch_router."""

from __future__ import annotations

import argparse
import sys

from omniinfer.proxy.config import RouterConfig, config_from_args, load_config_file

D = RouterConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="JSON file of flag values (flags given win)")
    w = p.add_argument_group("workers")
    w.add_argument("--host", default=D.host)
    w.add_argument("--port", type=int, default=D.port)
    w.add_argument("--worker-urls", nargs="*", default=[], help="regular-mode worker URLs")
    w.add_argument("--pd-disaggregation", action="store_true", help="prefill/decode mode")
    w.add_argument("--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]",
                   help="prefill worker and its bootstrap port (a number, 'none' or omitted)")
    w.add_argument("--decode", nargs=1, action="append", metavar="URL", help="decode worker")
    r = p.add_argument_group("routing")
    r.add_argument("--policy", default=D.policy, help="random, round_robin, power_of_two, "
                   "cache_aware or any registered policy (default cache_aware)")
    r.add_argument("--prefill-policy", default=None, help="PD: policy for prefill workers")
    r.add_argument("--decode-policy", default=None, help="PD: policy for decode workers")
    r.add_argument("--cache-threshold", type=float, default=D.cache_threshold)
    r.add_argument("--balance-abs-threshold", type=float, default=D.balance_abs_threshold,
                   help="imbalance gate, in requests' worth of in-flight tokens")
    r.add_argument("--balance-rel-threshold", type=float, default=D.balance_rel_threshold)
    r.add_argument("--max-tree-size", type=int, default=D.max_tree_size,
                   help="tokens per worker kept in the prefix index")
    r.add_argument("--apc-block-size", type=int, default=D.apc_block_size,
                   help="tokens per hashed prefix block")
    r.add_argument("--cache-truth", default=D.cache_truth, choices=["router", "kv-events"],
                   help="what fills the prefix index: 'router' (what it routed, LRU) or "
                   "'kv-events' (what each worker reports storing and evicting, over ZMQ; "
                   "workers need SGLang's --kv-events-config)")
    r.add_argument("--kv-events-endpoint", dest="kv_events_endpoints", action="append",
                   default=[], metavar="URL=tcp://HOST:PORT",
                   help="a worker's KV-event publisher, if not the one its /server_info names "
                   "(repeat per worker; repeat a worker for its DP ranks, in order)")
    r.add_argument("--kv-events-max-dp-size", type=int, default=D.kv_events_max_dp_size,
                   help="publishers (DP ranks) a worker's /server_info may name")
    r.add_argument("--kv-events-max-pages", type=int, default=D.kv_events_max_pages,
                   help="pages remembered per publisher; past it that view is reset")
    r.add_argument("--oas-ttft-slo-secs", type=float, default=None,
                   help="oas: the TTFT objective; waiting requests that can still meet it are "
                   "released before those that no longer can (which the hold bound still "
                   "releases in time). Default: no objective, short-and-old first for all")
    r.add_argument("--oas-lead-fraction", type=float, default=D.oas_lead_fraction,
                   help="oas: release a held request this fraction of a predicted cycle "
                   "before its instance's next batch boundary (0-1]")
    r.add_argument("--oas-hold-bound-cycles", type=float, default=D.oas_hold_bound_cycles,
                   help="oas: hold a request at most this many predicted batch cycles "
                   "(oas_goodput uses 32 whatever this says)")
    r.add_argument("--oas-batch-tokens", type=float, default=D.oas_batch_tokens,
                   help="oas: tokens of one prefill batch assumed until one is measured")
    r.add_argument("--oas-decode-max-running", type=int, default=D.oas_decode_max_running,
                   help="oas decode: requests running per decode worker before new ones wait "
                   "(0: the worker's reported max_running_requests)")
    r.add_argument("--model-path", default=None, help="served model (its tokenizer is used)")
    r.add_argument("--tokenizer-path", default=None, help="tokenizer, if not the model's")
    r.add_argument("--default-max-new-tokens", type=int, default=D.default_max_new_tokens,
                   help="expected output tokens when a request gives no limit")
    q = p.add_argument_group("admission, retries, health")
    q.add_argument("--max-payload-size", type=int, default=D.max_payload_size)
    q.add_argument("--request-timeout-secs", type=float, default=D.request_timeout_secs,
                   help="total time of one upstream attempt")
    q.add_argument("--upstream-connect-timeout-secs", type=float,
                   default=D.upstream_connect_timeout_secs)
    q.add_argument("--upstream-first-byte-timeout-secs", type=float,
                   default=D.upstream_first_byte_timeout_secs,
                   help="streams: time to the first event (queue + prefill)")
    q.add_argument("--upstream-idle-timeout-secs", type=float,
                   default=D.upstream_idle_timeout_secs,
                   help="streams: longest silence between two events")
    q.add_argument("--client-header-timeout-secs", type=float,
                   default=D.client_header_timeout_secs,
                   help="a client's request head must arrive within this")
    q.add_argument("--client-body-timeout-secs", type=float, default=D.client_body_timeout_secs)
    q.add_argument("--max-connections", type=int, default=D.max_connections,
                   help="open client connections; more are refused with a 503")
    q.add_argument("--tokenize-concurrency", type=int, default=D.tokenize_concurrency,
                   help="large prompts tokenized at once, off the event loop")
    q.add_argument("--max-concurrent-requests", type=int, default=D.max_concurrent_requests,
                   help="requests in flight (<= 0: unlimited)")
    q.add_argument("--queue-size", type=int, default=D.queue_size,
                   help="requests waiting for a slot; beyond it: 503 with Retry-After")
    q.add_argument("--queue-timeout-secs", type=float, default=D.queue_timeout_secs)
    q.add_argument("--retry-max-retries", type=int, default=D.retry_max_retries)
    q.add_argument("--retry-initial-backoff-ms", type=float, default=D.retry_initial_backoff_ms)
    q.add_argument("--retry-max-backoff-ms", type=float, default=D.retry_max_backoff_ms)
    q.add_argument("--retry-backoff-multiplier", type=float, default=D.retry_backoff_multiplier)
    q.add_argument("--retry-jitter-factor", type=float, default=D.retry_jitter_factor)
    q.add_argument("--disable-retries", action="store_true")
    q.add_argument("--health-failure-threshold", type=int, default=D.health_failure_threshold)
    q.add_argument("--health-success-threshold", type=int, default=D.health_success_threshold)
    q.add_argument("--health-check-timeout-secs", type=float, default=D.health_check_timeout_secs)
    q.add_argument("--health-check-interval-secs", type=float,
                   default=D.health_check_interval_secs)
    q.add_argument("--health-check-endpoint", default=D.health_check_endpoint)
    q.add_argument("--disable-health-check", action="store_true")
    q.add_argument("--cb-failure-threshold", type=int, default=D.cb_failure_threshold)
    q.add_argument("--cb-success-threshold", type=int, default=D.cb_success_threshold)
    q.add_argument("--cb-timeout-duration-secs", type=float, default=D.cb_timeout_duration_secs)
    q.add_argument("--disable-circuit-breaker", action="store_true")
    q.add_argument("--loads-poll-interval-secs", type=float, default=D.loads_poll_interval_secs,
                   help="poll each worker's /v1/loads this often (0: never)")
    a = p.add_argument_group("security (as sglang_router)")
    a.add_argument("--api-key", default=None,
                   help="sent to workers as 'Authorization: Bearer KEY'; clients must present "
                   "it too (except /health* and /metrics), as SGLang's server requires")
    a.add_argument("--control-plane-api-keys", nargs="*", default=[],
                   metavar="ID:NAME:ROLE:KEY",
                   help="named keys, role admin (admin routes and data plane) or user (data "
                   "plane). Without an admin key, /add_worker, /remove_worker and /flush_cache "
                   "answer loopback clients only")
    a.add_argument("--control-plane-audit-enabled", action="store_true",
                   help="log each admin call: key id, role, method, path, outcome")
    o = p.add_argument_group("observability")
    o.add_argument("--access-log", default=None, help="JSONL file, one line per request")
    o.add_argument("--access-log-max-bytes", type=int, default=D.access_log_max_bytes,
                   help="rotate the access log past this size")
    o.add_argument("--access-log-backups", type=int, default=D.access_log_backups)
    o.add_argument("--prometheus-host", default=None, help="also serve /metrics on this host")
    o.add_argument("--prometheus-port", type=int, default=None, help="... and this port")
    o.add_argument("--log-level", default=D.log_level, choices=["debug", "info", "warn", "error"])


def _apply_config_file(args: argparse.Namespace) -> None:
    """Values from ``--config`` fill every flag left at its default (given flags win)."""
    for key, value in load_config_file(args.config).items():
        current = getattr(args, key, None)
        if current is None or current == getattr(D, key, None) or current in ([], False):
            setattr(args, key, value)


def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "config", None):
            _apply_config_file(args)
        config = config_from_args(args)
        from omniinfer.proxy.base import available_policies

        known = available_policies()
        for role in ("regular", "prefill", "decode"):
            if config.policy_for(role) not in known:
                raise ValueError(f"unknown policy {config.policy_for(role)!r}; "
                                 f"known: {', '.join(known)}")
    except (ValueError, OSError) as exc:
        print(f"omniinfer router: error: {exc}", file=sys.stderr)
        return 2
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
