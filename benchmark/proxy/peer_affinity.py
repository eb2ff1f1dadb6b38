"""Does a router keep a prefix group on one worker when nothing is loaded? A peer-fidelity check.

``prefix_eval.py`` sends token ids (``/generate`` with ``input_ids``). smg's HTTP cache-aware
policy matches a character tree over ``extract_text_for_routing``, which for token ids is the
ids joined by spaces, so the question is whether that request form starves it. Here every
target routes the same ``prefix-groups`` requests one at a time (no load, so no
load-balancing fallback can act) to 8 emulated workers with the benchmark's KV pool, once as
token ids and once as the decoded text, on flushed caches and a fresh router each time. A
router with perfect affinity reaches ``ideal``: every request of a group after its first reuses
the group's prefix. Equal shares for both encodings, at or near ``ideal``, mean the encoding is
not what limits a peer under load.

    python benchmark/proxy/peer_affinity.py      # results/proxy/prefix/peer_affinity.json
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path
from typing import Any

from cluster import (
    EmulatedCluster,
    free_port,
    omni_router_args,
    omni_router_command,
    peer_router_command,
    start_router,
)
from prefix_eval import TOKENIZER, Target, _load_tokenizer
from tqdm import tqdm

from omniinfer.bench.prefix_workloads import PREFIX_WORKLOADS
from omniinfer.bench.workloads import BenchRequest, WorkloadSpec

HERE = Path(__file__).resolve().parent

DEFAULT_TARGETS = ("omni:cache_aware,omni:oas,smg:cache_aware,smg:prefix_hash,"
                   "smg:consistent_hashing,smg:round_robin")
ENCODINGS = ("input_ids", "text")


def ideal_share(requests: list[BenchRequest], prefix_len: int) -> float:
    """Cached share with perfect affinity and room: every visit of a group but its first reuses
    the group's prefix."""
    seen: set[int | None] = set()
    cached = 0
    for r in requests:
        if r.group in seen:
            cached += prefix_len
        seen.add(r.group)
    return cached / sum(r.prompt_tokens for r in requests)


def send_all(port: int, requests: list[BenchRequest], encoding: str, tokenizer: Any) -> float:
    """The requests one after another; the share of prompt tokens the workers reported cached."""
    cached = total = 0
    for r in requests:
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": r.output_tokens}}
        if encoding == "text":
            body["text"] = tokenizer.decode(list(r.input_ids or ()))
        else:
            body["input_ids"] = list(r.input_ids or ())
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            meta = json.load(resp)["meta_info"]
        cached += int(meta.get("cached_tokens") or 0)
        total += int(meta["prompt_tokens"])
    return cached / max(1, total)


def router_command(target: Target, cluster: EmulatedCluster, port: int) -> list[str]:
    if target.router == "omni":
        return omni_router_command(omni_router_args(cluster, target.policy, target.policy, None,
                                                    target.truth), port)
    return peer_router_command("smg", cluster, target.policy, port)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=DEFAULT_TARGETS, help="comma list of router:policy")
    p.add_argument("--requests", type=int, default=80, help="one round = groups x users")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--users-per-group", type=int, default=5)
    p.add_argument("--prefix-len", type=int, default=6144)
    p.add_argument("--query-len", type=int, default=1200)
    p.add_argument("--cache-tokens", type=int, default=40960, help="as prefix_eval.py")
    p.add_argument("--tokenizer", default=str(TOKENIZER))
    p.add_argument("--output", type=Path,
                   default=HERE.parent / "results" / "proxy" / "prefix" / "peer_affinity.json")
    args = p.parse_args()
    targets = [Target.parse(t) for t in args.targets.split(",")]
    tokenizer = _load_tokenizer(args.tokenizer)
    spec = WorkloadSpec(num_requests=args.requests, output_len=4, seed=0,
                        prefix_len=args.prefix_len, num_groups=args.groups,
                        users_per_group=args.users_per_group, query_len=args.query_len,
                        max_total_len=8000, vocab_size=49152)
    requests = PREFIX_WORKLOADS["prefix-groups"](spec, tokenizer)
    ideal = ideal_share(requests, args.prefix_len)
    log_dir = args.output.parent / "logs" / "peer_affinity"
    cluster = EmulatedCluster(0, 0, "h100-llama3-8b", 1.0, log_dir, kv_events=True, n_regular=8,
                              cache_extra=("--max-total-tokens", str(args.cache_tokens)))
    rows: list[dict[str, Any]] = []
    try:
        for target in tqdm(targets, unit="target"):
            for encoding in ENCODINGS:
                cluster.flush()
                port = free_port()
                name = target.name.replace(":", "_").replace("@", "_")
                router = start_router(router_command(target, cluster, port), port,
                                      log_dir / f"{name}_{encoding}.log")
                try:
                    share = send_all(port, requests, encoding, tokenizer)
                finally:
                    router.stop()
                rows.append({"target": target.name, "encoding": encoding, "cached_share": share})
    finally:
        cluster.stop()
    print(f"{len(requests)} requests one at a time, 8 workers, ideal cached share {ideal:.1%}")
    print("| router:policy | " + " | ".join(ENCODINGS) + " |\n|---|---|---|")
    for target in targets:
        shares = [next(r["cached_share"] for r in rows
                       if r["target"] == target.name and r["encoding"] == e) for e in ENCODINGS]
        print(f"| {target.name} | " + " | ".join(f"{s:.1%}" for s in shares) + " |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    meta = {**vars(args), "tokenizer": Path(args.tokenizer).name, "output": args.output.name}
    args.output.write_text(json.dumps({"meta": meta, "ideal_share": ideal, "rows": rows},
                                      indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
