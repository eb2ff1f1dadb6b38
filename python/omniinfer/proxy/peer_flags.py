"""sglang-router 0.3.2 flags OmniProxy has no setting for (and two of smg 1.13's):
accepted with a note, or refused.

A deployment written for ``python -m sglang_router.launch_router`` must not die of an unknown
flag. Every flag of that router that OmniProxy does not implement as a setting is listed here
with what it does in OmniProxy:

``inert``    accepted; the behaviour the flag tunes does not exist in OmniProxy (a policy it does
             not have, a periodic pass it does not need), so the value changes nothing and the
             router says so in one line at start-up;
``default``  accepted while the value asks for what OmniProxy does anyway (``accepts``); any other
             value is refused;
``refused``  not supported (yet): the router does not start and names the flag with the reason,
             one line per flag, so a deployment never runs without a feature it asked for.

Pure: no I/O, no imports of the router.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

INERT, DEFAULT, REFUSED = "inert", "default", "refused"


@dataclass(frozen=True)
class PeerFlag:
    name: str  # without the leading dashes
    status: str  # INERT, DEFAULT or REFUSED
    reason: str
    nargs: str | None = None  # argparse nargs; "switch" for a store_true flag
    accepts: tuple[str, ...] = ()  # DEFAULT: the values taken as OmniProxy's own behaviour


_HISTORY = "conversation history storage (the responses API's) is not supported"
_JWT = "JWT authentication is not supported: use --api-key or --control-plane-api-keys"
_TOKENIZER_CACHE = ("OmniProxy keeps no tokenizer cache (it tokenizes only for cache-aware "
                    "routing, off the event loop)")
_IN_WORKER = "in HTTP mode the SGLang worker applies it: give it to the server instead"

PEER_FLAGS: tuple[PeerFlag, ...] = (
    PeerFlag("bucket-adjust-interval-secs", INERT,
             "tunes sglang-router's bucket policy, which OmniProxy does not have"),
    PeerFlag("eviction-interval-secs", INERT,
             "the prefix index evicts its least recently used entries as it grows past "
             "--max-tree-size, so there is no periodic eviction to schedule"),
    PeerFlag("max-idle-secs", INERT, "tunes sglang-router's manual policy, which OmniProxy "
             "does not have"),
    PeerFlag("assignment-mode", INERT, "tunes sglang-router's manual policy, which OmniProxy "
             "does not have"),
    PeerFlag("mini-lb", INERT, "selects sglang-router's Python mini load balancer for PD; "
             "OmniProxy is the load balancer", nargs="switch"),
    PeerFlag("worker-startup-timeout-secs", INERT,
             "OmniProxy starts at once and admits each worker when its health check passes "
             "(--health-check-*), so there is no start-up wait to bound"),
    PeerFlag("worker-startup-check-interval", INERT,
             "OmniProxy starts at once and admits each worker when its health check passes "
             "(--health-check-interval-secs)"),
    PeerFlag("prometheus-duration-buckets", INERT,
             "OmniProxy's duration histograms have fixed buckets", nargs="+"),
    PeerFlag("cb-window-duration-secs", INERT, "the circuit breaker opens on consecutive "
             "failures (--cb-failure-threshold), not on failures within a window"),
    PeerFlag("tokenizer-cache-enable-l0", INERT, _TOKENIZER_CACHE, nargs="switch"),
    PeerFlag("tokenizer-cache-l0-max-entries", INERT, _TOKENIZER_CACHE),
    PeerFlag("tokenizer-cache-enable-l1", INERT, _TOKENIZER_CACHE, nargs="switch"),
    PeerFlag("tokenizer-cache-l1-max-memory", INERT, _TOKENIZER_CACHE),
    PeerFlag("chat-template", INERT, f"the chat template: {_IN_WORKER} (--chat-template)"),
    PeerFlag("reasoning-parser", INERT, f"the reasoning parser: {_IN_WORKER} "
             "(--reasoning-parser)"),
    PeerFlag("tool-call-parser", INERT, f"the tool-call parser: {_IN_WORKER} "
             "(--tool-call-parser)"),
    PeerFlag("dp-minimum-tokens-scheduler", INERT, "smg's rank choice by fewest tokens: "
             "OmniProxy's --dp-aware already sends each request to the rank with the fewest "
             "tokens in flight (without --dp-aware no rank is named)", nargs="switch"),
    PeerFlag("disable-load-monitoring", INERT, "smg's switch for its conditional load "
             "polling; OmniProxy polls loads as --loads-poll-interval-secs and --load-feed say",
             nargs="switch"),
    PeerFlag("backend", DEFAULT, "OmniProxy routes to SGLang workers only", accepts=("sglang",)),
    PeerFlag("history-backend", DEFAULT, _HISTORY, accepts=("memory", "none")),
    PeerFlag("enable-igw", REFUSED, "the multi-model inference gateway mode is not supported",
             nargs="switch"),
    PeerFlag("mcp-config-path", REFUSED, "MCP tool servers are not supported"),
    *(PeerFlag(name, REFUSED, _HISTORY) for name in (
        "oracle-wallet-path", "oracle-tns-alias", "oracle-connect-descriptor", "oracle-username",
        "oracle-password", "oracle-pool-min", "oracle-pool-max", "oracle-pool-timeout-secs",
        "postgres-db-url", "postgres-pool-max", "redis-url", "redis-pool-max",
        "redis-retention-days")),
    *(PeerFlag(name, REFUSED, _JWT, nargs="*" if name == "jwt-role-mapping" else None)
      for name in ("jwt-issuer", "jwt-audience", "jwt-jwks-uri", "jwt-role-mapping")),
)
BY_DEST = {f.name.replace("-", "_"): f for f in PEER_FLAGS}


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """The flags, each parsed as sglang-router parses it (a flag not given stays absent)."""
    group = parser.add_argument_group(
        "sglang-router flags without an OmniProxy setting (accepted with a note, or refused)")
    for flag in PEER_FLAGS:
        option = "--" + flag.name
        if flag.nargs == "switch":
            group.add_argument(option, action="store_true", help=flag.reason)
        else:
            group.add_argument(option, nargs=flag.nargs, metavar="VALUE", help=flag.reason)


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def split_peer_flags(values: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``values`` without the peer flags, the notes for accepted ones and one refusal line per
    refused one (``--flag: reason``)."""
    rest, notes, refusals = {}, [], []
    for dest, value in values.items():
        flag = BY_DEST.get(dest)
        if flag is None:
            rest[dest] = value
            continue
        if value is False:  # a switch written as false in a config file
            continue
        option = "--" + flag.name
        if flag.status == INERT:
            notes.append(f"{option} accepted without effect: {flag.reason}")
        elif flag.status == DEFAULT and _shown(value) in flag.accepts:
            notes.append(f"{option} {_shown(value)} accepted: what OmniProxy does anyway")
        elif flag.status == DEFAULT:
            refusals.append(f"{option} {_shown(value)}: {flag.reason} (accepted: "
                            f"{', '.join(flag.accepts)})")
        else:
            refusals.append(f"{option}: {flag.reason}")
    return rest, notes, refusals
