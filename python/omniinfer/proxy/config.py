"""The router's one configuration surface: ``sglang_router.launch_router``-compatible flags
(``cli``), optionally mirrored in a JSON file (``--config``, keys are flag names), into these
typed fields, which hold every default."""

from __future__ import annotations

import argparse
import dataclasses

from omniinfer.proxy.cors import check_origins
from omniinfer.proxy.tls import server_context, worker_context

# where a client's request id is read from, first present wins (sglang-router's defaults)
DEFAULT_REQUEST_ID_HEADERS = ("x-request-id", "x-correlation-id", "x-trace-id", "request-id")
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def check_header_names(names: list[str] | None) -> None:
    """ValueError unless each is an HTTP header name (RFC 9110 token), at most 16 of 64 chars."""
    if names is None:
        return
    if len(names) > 16:
        raise ValueError("--request-id-headers: at most 16 names")
    for name in names:
        if not name or len(name) > 64 or not set(name) <= _TOKEN:
            raise ValueError(f"--request-id-headers: {name[:80]!r} is not a header name")


@dataclasses.dataclass
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 30000
    worker_urls: list[str] = dataclasses.field(default_factory=list)
    pd_disaggregation: bool = False
    prefill_urls: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)
    decode_urls: list[str] = dataclasses.field(default_factory=list)
    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.5
    balance_abs_threshold: float = 32
    balance_rel_threshold: float = 1.1
    max_tree_size: int = 1 << 24  # tokens per worker in the prefix index
    apc_block_size: int = 16
    cache_truth: str = "router"  # "router": own index, filled on route; "kv-events": workers' events
    kv_events_endpoints: list[str] = dataclasses.field(default_factory=list)  # URL=tcp://H:P
    oas_ttft_slo_secs: float | None = None  # OAS: requests that can still meet it go first
    oas_lead_fraction: float = 1.0  # OAS: release this fraction of a cycle before the boundary
    oas_hold_bound_cycles: float = 32.0  # OAS: longest hold, in predicted batch cycles
    oas_batch_tokens: float = 8192.0  # OAS: assumed batch budget until one is measured
    oas_decode_max_running: int = 0  # OAS decode: running cap per worker (0: its own report)
    model_path: str | None = None
    tokenizer_path: str | None = None
    max_payload_size: int = 256 * 1024 * 1024
    max_response_size: int = 64 * 1024 * 1024  # a worker's non-streamed answer, read whole
    request_timeout_secs: float = 1800.0  # sglang_router's meaning: the total per attempt
    upstream_connect_timeout_secs: float = 10.0
    upstream_first_byte_timeout_secs: float = 600.0  # streams: until the first event
    upstream_idle_timeout_secs: float = 300.0  # streams: between two reads
    client_header_timeout_secs: float = 30.0  # a connection's request head, first byte to last
    client_body_timeout_secs: float = 60.0
    client_write_timeout_secs: float = 60.0  # a client that accepts no byte of its answer
    max_connections: int = 8192  # open client connections; beyond: refused with a 503
    tokenize_concurrency: int = 2  # prompts tokenized at once, off the event loop
    api_key: str | None = None  # presented to workers; clients must present it too
    control_plane_api_keys: list[str] = dataclasses.field(default_factory=list)  # id:name:role:key
    control_plane_audit_enabled: bool = False
    max_concurrent_requests: int = 1024
    queue_size: int = 1024
    queue_timeout_secs: float = 60.0
    retry_max_retries: int = 3
    retry_initial_backoff_ms: float = 20.0
    retry_max_backoff_ms: float = 2000.0
    retry_backoff_multiplier: float = 2.0
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: float = 5.0
    health_check_interval_secs: float = 10.0
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False
    cb_failure_threshold: int = 5
    cb_success_threshold: int = 2
    cb_timeout_duration_secs: float = 10.0
    disable_circuit_breaker: bool = False
    loads_poll_interval_secs: float = 1.0
    load_feed: str = "auto"  # auto: a worker's advertised load feed replaces polling it
    dp_aware: bool = False  # send each request to a DP rank of its worker (``dp.py``)
    default_max_new_tokens: int = 128
    access_log: str | None = None
    access_log_max_bytes: int = 256 << 20  # rotate past this size
    access_log_backups: int = 3
    kv_events_max_dp_size: int = 64  # publishers a worker's /server_info may name
    kv_events_max_pages: int = 1 << 22  # pages remembered per publisher; beyond: reset
    kv_events_max_tokens: int = 1 << 20  # tokens remembered per worker (~65-160 B each); oldest go
    kv_events_max_message_bytes: int = 4 << 20  # larger KV-event messages drop the connection
    prometheus_host: str | None = None
    prometheus_port: int | None = None
    log_level: str = "info"
    log_dir: str | None = None  # also write the log to LOG_DIR/omniproxy.log
    shutdown_grace_period_secs: float = 180.0  # in-flight requests' time to finish (the peer's)
    tls_cert_path: str | None = None  # serve HTTPS (``tls.py``)
    tls_key_path: str | None = None
    ca_cert_paths: list[str] = dataclasses.field(default_factory=list)  # for https:// workers
    client_cert_path: str | None = None  # presented to https:// workers (mutual TLS)
    client_key_path: str | None = None
    request_id_headers: list[str] | None = None  # None: DEFAULT_REQUEST_ID_HEADERS
    cors_allowed_origins: list[str] = dataclasses.field(default_factory=list)  # ``cors.py``
    rate_limit_tokens_per_second: float | None = None  # ``admission.RateLimit``
    enable_trace: bool = False  # OpenTelemetry spans over OTLP (``tracing.py``)
    otlp_traces_endpoint: str = "localhost:4317"  # sglang-router's default (gRPC)
    service_discovery: bool = False  # workers from Kubernetes pods (``discovery.py``)
    selector: list[str] = dataclasses.field(default_factory=list)  # KEY=VALUE, regular mode
    prefill_selector: list[str] = dataclasses.field(default_factory=list)
    decode_selector: list[str] = dataclasses.field(default_factory=list)
    service_discovery_port: int = 80  # the workers' HTTP port (sglang-router's default)
    service_discovery_namespace: str | None = None  # None: every namespace

    @property
    def max_attempts(self) -> int:
        return 1 if self.disable_retries else 1 + max(0, self.retry_max_retries)

    def policy_for(self, role: str) -> str:
        if role == "prefill" and self.prefill_policy:
            return self.prefill_policy
        if role == "decode" and self.decode_policy:
            return self.decode_policy
        return self.policy

    def validate(self) -> None:
        if self.enable_trace:
            from omniinfer.proxy.tracing import check

            check()
        if self.service_discovery:
            from omniinfer.proxy.discovery import rules_from

            rules_from(self)
        if self.pd_disaggregation:
            if not self.service_discovery and (not self.prefill_urls or not self.decode_urls):
                raise ValueError("--pd-disaggregation needs at least one --prefill and one --decode")
            if self.worker_urls:
                raise ValueError("--worker-urls is for regular mode; use --prefill/--decode in PD mode")
        elif self.prefill_urls or self.decode_urls:
            raise ValueError("--prefill/--decode need --pd-disaggregation")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be within [0, 1]")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= 65535:
            raise ValueError("--prometheus-port must be within [0, 65535]")
        check_origins(self.cors_allowed_origins)
        check_header_names(self.request_id_headers)
        if self.rate_limit_tokens_per_second is not None \
                and not 0 < self.rate_limit_tokens_per_second <= 1e9:
            raise ValueError("--rate-limit-tokens-per-second must be within (0, 1e9]")
        server_context(self.tls_cert_path, self.tls_key_path)  # files readable, pairs whole
        worker_context(self.ca_cert_paths, self.client_cert_path, self.client_key_path)
        if not 0.0 <= self.shutdown_grace_period_secs <= 86400.0:
            raise ValueError("--shutdown-grace-period-secs must be within [0, 86400]")
        if self.apc_block_size <= 0:
            raise ValueError("--apc-block-size must be positive")
        if self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-rel-threshold must be >= 1")
        if self.cache_truth not in ("router", "kv-events"):
            raise ValueError("--cache-truth must be 'router' or 'kv-events'")
        if self.oas_ttft_slo_secs is not None and not self.oas_ttft_slo_secs > 0:
            raise ValueError("--oas-ttft-slo-secs must be positive")
        for name in ("upstream_connect_timeout_secs", "upstream_first_byte_timeout_secs",
                     "upstream_idle_timeout_secs", "client_header_timeout_secs",
                     "client_body_timeout_secs", "client_write_timeout_secs",
                     "request_timeout_secs", "oas_batch_tokens",
                     "oas_hold_bound_cycles"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if not 0.0 < self.oas_lead_fraction <= 1.0:
            raise ValueError("--oas-lead-fraction must be within (0, 1]")
        for name in ("oas_decode_max_running", "max_connections", "tokenize_concurrency",
                     "access_log_max_bytes", "access_log_backups", "kv_events_max_dp_size",
                     "kv_events_max_pages", "max_payload_size", "max_response_size",
                     "kv_events_max_tokens", "kv_events_max_message_bytes"):
            if getattr(self, name) < (0 if name in ("oas_decode_max_running",
                                                    "access_log_backups") else 1):
                raise ValueError(f"--{name.replace('_', '-')} is out of range")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        from omniinfer.proxy.auth import parse_control_plane_keys

        parse_control_plane_keys(self.control_plane_api_keys)
        if self.kv_events_endpoints:
            if self.cache_truth != "kv-events":
                raise ValueError("--kv-events-endpoint needs --cache-truth kv-events")
            from omniinfer.proxy.cache_truth import parse_endpoint_overrides

            parse_endpoint_overrides(self.kv_events_endpoints)


def parse_prefill(entries: list[list[str]] | None) -> list[tuple[str, int | None]]:
    """``--prefill URL [BOOTSTRAP_PORT|none]`` groups, as sglang_router reads them."""
    out: list[tuple[str, int | None]] = []
    for entry in entries or []:
        if len(entry) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {' '.join(entry)}")
        port: int | None = None
        if len(entry) == 2 and entry[1].lower() != "none":
            try:
                port = int(entry[1])
            except ValueError:
                raise ValueError(
                    f"invalid bootstrap port {entry[1]!r}: a number or 'none'") from None
            if not 0 < port < 65536:
                raise ValueError(f"bootstrap port out of range: {port}")
        out.append((entry[0], port))
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """A validated config from parsed flags; a flag absent (or None) keeps its default."""
    given = vars(args)
    names = {f.name for f in dataclasses.fields(RouterConfig)}
    values = {k: v for k, v in given.items() if k in names and v is not None}
    values["prefill_urls"] = parse_prefill(given.get("prefill"))
    values["decode_urls"] = [d[0] for d in given.get("decode") or []]
    config = RouterConfig(**values)
    config.validate()
    return config
