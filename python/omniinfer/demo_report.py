"""What the demo prints per technique, read from the servers' and the router's own reports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

PLACEMENT_FLAGS = ["--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2",
                   "--enable-omni-placement", "--omni-placement-interval", "4",
                   "--omni-placement-trigger", "1.02", "--omni-placement-margin", "0.01"]


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return json.loads(text) if text.lstrip().startswith("{") else text


def attn_lines(prefill_url: str, decode_url: str) -> list[str]:
    decode = _get(decode_url + "/omni/attn")
    if not decode.get("enabled"):
        return ["OmniAttn: off (no pattern)"]
    pools = decode["pools"]
    full, comp = pools["full"], pools["compressed"]
    baseline = pools.get("uncompressed_bytes_for_max_total_tokens")
    lines = [f"OmniAttn (decode server): {comp['layers']} of {full['layers'] + comp['layers']} "
             f"layers compressed (sink {decode['pattern']['sink']} + recent "
             f"{decode['pattern']['recent']}); KV pools {(full['bytes'] + comp['bytes']) / 2**20:.0f}"
             f" MiB" + (f" for the tokens {baseline / 2**20:.0f} MiB hold without a pattern"
                        if baseline else "") + f"; {decode['tokens_freed']} compressed slots "
             "freed early"]
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


def placement_stage(log_dir: Path, policy: str) -> list[str]:
    """A tiny Qwen3-MoE PD pair with placement on; its imbalance and migrations."""
    from omniinfer.launch import cpu_env
    from omniinfer.launch_pd import pd_server, router_args, started
    from omniinfer.models import tiny
    from omniinfer.proxy.process import RouterProcess

    model = tiny.build("qwen3_moe", log_dir / "tiny-qwen3-moe", seed=0,
                       tokenizer=tiny.train_tokenizer())
    servers = [pd_server(model, mode, log_dir, 4096, PLACEMENT_FLAGS, f"moe-{mode}")
               for mode in ("prefill", "decode")]
    for server in servers:
        server.env = cpu_env(server.env, threads_bind="0|1")
    print("[demo] OmniPlacement: a Qwen3-MoE prefill and decode pair, 2 expert-parallel ranks "
          "each, placement on", flush=True)
    with started(servers):
        args = [*router_args(servers), "--prefill-policy", policy, "--decode-policy", policy,
                "--model-path", str(model)]
        with RouterProcess(args, log_dir / "omniproxy-moe.log") as router:
            body = json.dumps({"text": "O Romeo, Romeo! wherefore art thou Romeo? " * 3,
                               "sampling_params": {"max_new_tokens": 16}}).encode()
            for _ in range(12):
                request = urllib.request.Request(router.base_url + "/generate", data=body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=300) as r:
                    r.read()
        status = _get(servers[1].base_url + "/omni/placement")
    adopted = [m for m in status.get("migrations", []) if m.get("state") == "adopted"]
    decisions = status.get("decisions", [])
    first = next((d for d in decisions if d.get("adopted_layers")), None)
    lines = [f"OmniPlacement (decode server): {len(decisions)} decisions, {len(adopted)} "
             "migrations adopted while serving PD traffic"]
    if first is not None:
        lines.append(f"OmniPlacement: imbalance max/mean per layer {first['b_before']} before, "
                     f"{first['b_after_planned']} planned after (pass {first['pass']})")
    return lines
