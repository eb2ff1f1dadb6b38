"""What the demo prints per technique, read from the servers' and the router's own reports."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any

MAX_REPORT_BYTES = 8 << 20  # a server's /omni/* status or the router's /metrics: kilobytes


def _get(url: str) -> Any:
    """The JSON (or text) ``url`` answers; ValueError past ``MAX_REPORT_BYTES`` (with
    ``--attach`` the servers are whatever the router lists)."""
    with urllib.request.urlopen(url, timeout=30) as r:
        raw = r.read(MAX_REPORT_BYTES + 1)
    if len(raw) > MAX_REPORT_BYTES:
        raise ValueError(f"{url} answered more than {MAX_REPORT_BYTES} bytes")
    text = raw.decode(errors="replace")
    return json.loads(text) if text.lstrip().startswith("{") else text


def attn_lines(prefill_url: str, decode_url: str) -> list[str]:
    decode = _get(decode_url + "/omni/attn")
    if not decode.get("enabled"):
        return ["OmniAttn: off (no pattern)"]
    pools = decode["pools"]
    full, comp = pools["full"], pools["compressed"]
    read, full_read = decode.get("compressed_keys_read", 0), decode.get(
        "compressed_keys_full_attention", 0)
    share = f"{100 * read / full_read:.0f} %" if full_read else "n/a"
    lines = [f"OmniAttn (decode server): {comp['layers']} of {full['layers'] + comp['layers']} "
             f"layers compressed (sink {decode['pattern']['sink']} + recent "
             f"{decode['pattern']['recent']}); KV pools {full['tokens']} full-layer and "
             f"{comp['tokens']} compressed-layer token slots in the memory of "
             f"{pools.get('max_total_tokens') or full['tokens']} unpatterned tokens; compressed "
             f"layers read {share} of the keys full attention would; {decode['tokens_freed']} "
             "compressed slots freed early"]
    sent = _get(prefill_url + "/omni/attn").get("pd_transfer")
    if sent:
        lines.append(f"OmniAttn (PD transfer): {sent['requests']} requests, "
                     f"{(sent['full_layer_bytes'] + sent['compressed_layer_bytes']) / 2**20:.1f}"
                     f" MiB sent for {sent['bytes_without_pattern'] / 2**20:.1f} MiB without the "
                     f"pattern ({100 * (sent['saved_fraction'] or 0):.0f} % saved)")
    return lines


def oas_lines(router_url: str) -> list[str]:
    text = _get(router_url + "/metrics")
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^omniproxy_routing_decisions_total\{([^}]*)\} (\S+)",
                                    text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = f"{fields.get('role', '?')}:{fields.get('reason', '?')}"
        counts[key] = counts.get(key, 0) + float(value)
    shown = ", ".join(f"{k} {int(v)}" for k, v in sorted(counts.items()))
    return [f"OmniProxy (OAS) decisions by role and reason: {shown or 'none'}"]


def placement_lines(decode_url: str) -> list[str]:
    """The decode server's placement controller: decisions, migrations adopted, and the
    imbalance of the first adopted decision's layers before and as planned after."""
    status = _get(decode_url + "/omni/placement")
    if not isinstance(status, dict) or not status.get("enabled"):
        return ["OmniPlacement: off"]
    adopted = [m for m in status.get("migrations", []) if m.get("state") == "adopted"]
    decisions = status.get("decisions", [])
    lines = [f"OmniPlacement (decode server): {len(decisions)} decisions, {len(adopted)} "
             f"migrations adopted while serving PD traffic ({status['rank_count']} "
             "expert-parallel ranks)"]
    first = next((d for d in decisions if d.get("adopted_layers")), None)
    if first is not None:
        before, after = first["b_before"], first["b_after_planned"]
        lines.append(f"OmniPlacement: expert-load imbalance (busiest rank / mean) over "
                     f"{len(before)} layers, mean {sum(before) / len(before):.3f} (worst "
                     f"{max(before):.3f}) before, {sum(after) / len(after):.3f} (worst "
                     f"{max(after):.3f}) planned after (pass {first['pass']})")
    return lines
