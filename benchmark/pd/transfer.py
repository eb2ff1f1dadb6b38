"""What a real KV transfer costs: real SGLang prefill -> decode over Mooncake's TCP transport.

Starts one prefill, one decode and one plain (non-PD) SGLang server on this CPU (SmolLM2-135M,
fp32, the stock commands with the plugin's CPU defaults). For each prompt length (128 .. 4,096
tokens, random token ids, a few repeats, interleaved) it sends

- to the plain server: a streaming ``/generate`` with one output token -> plain TTFT;
- to the PD pair, as a PD router does (same body to both with ``bootstrap_host/port/room``):
  PD TTFT = the decode server's first streamed token; SGLang's own transfer time and speed for
  that request, read back from the prefill server's ``/v1/loads`` (last finished transfer).

The PD overhead ``PD TTFT - plain TTFT`` is what the emulator's ``transfer`` terms stand for
(the time between a finished prefill and the decode side's first token), so the script fits
``overhead = latency_s + tokens * kv_bytes_per_token / bandwidth`` to the per-length medians
(least squares) and, with ``--write-profile``, writes the fitted terms into the ``cpu-smollm2``
emulator profile. Prints a table, writes ``results/transfer.json`` and ``results/transfer.png``.

With ``--compare-spin`` a second PD pair runs with SGLang's own waiting (its schedulers spin
while a request waits for KV or for the peer), interleaved with the first: on a machine where
prefill and decode share the cores, that spinning slows the prefill forward itself.

    python benchmark/pd/transfer.py --compare-spin --write-profile   # ~12 min on 2 cores
Run it on a quiet machine: the two cores are shared by all the servers.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omniinfer.cpu.server_defaults import PD_POLL_MS_ENV
from omniinfer.testbed.pd_servers import load, pd_server, plain_server, started

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PROFILE = ROOT / "python" / "omniinfer" / "emulator" / "profiles" / "cpu-smollm2.yaml"
LENGTHS = (128, 256, 512, 1024, 2048, 4096)


def _post(url: str, body: dict[str, Any], stream: bool) -> tuple[float, Any]:
    """POST and return (seconds to the first token or the whole answer, last JSON payload)."""
    started_at = time.perf_counter()
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        if not stream:
            data = json.loads(response.read())
            return time.perf_counter() - started_at, data
        first: float | None = None
        last: Any = None
        for line in response:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                last = json.loads(line[5:])
                if first is None and last.get("output_ids"):
                    first = time.perf_counter() - started_at
        if first is None:
            raise RuntimeError(f"no token from {url}: {last}")
        return first, last


def _body(ids: list[int], new_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream, **extra,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                "ignore_eos": True}}


def measure_pd(prefill: Any, decode: Any, ids: list[int], pool: Any) -> dict[str, float]:
    room = random.getrandbits(63)
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}
    p = pool.submit(_post, prefill.base_url + "/generate", _body(ids, 2, False, **boot), False)
    d = pool.submit(_post, decode.base_url + "/generate", _body(ids, 2, True, **boot), True)
    ttft, _ = d.result()
    p_done, _ = p.result()
    disagg = load(prefill.base_url)["disaggregation"]
    return {"pd_ttft_s": ttft, "prefill_response_s": p_done,
            "sglang_transfer_ms": float(disagg["kv_transfer_latency_ms"]),
            "sglang_speed_gb_s": float(disagg["kv_transfer_speed_gb_s"])}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def kv_bytes_per_token(profile: Path) -> int:
    match = re.search(r"kv_bytes_per_token:\s*(\d+)", profile.read_text())
    if not match:
        raise SystemExit(f"{profile}: no transfer.kv_bytes_per_token")
    return int(match.group(1))


def write_profile(profile: Path, bandwidth_gb_s: float, latency_s: float, when: str) -> None:
    """Replace the two fitted transfer lines, keeping the profile's comment column."""
    text = profile.read_text()
    lines = {
        "bandwidth_gb_s": (f"{bandwidth_gb_s:.4g}",
                           f"fitted by benchmark/pd/transfer.py on {when}: real PD over Mooncake TCP"),
        "latency_s": (f"{latency_s:.4g}", "fitted intercept (handshake, decode-side scheduling)"),
    }
    for key, (value, note) in lines.items():
        line = f"  {key}: {value}".ljust(41) + f"# {note}"
        text = re.sub(rf"^  {key}: .*$", line, text, flags=re.MULTILINE)
    profile.write_text(text)


def plot(rows: list[dict[str, Any]], latency: float, slope: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["tokens"] for r in rows]
    ax.plot(xs, [r["overhead_ms"] for r in rows], "o-", label="PD TTFT - plain TTFT (median)")
    ax.plot(xs, [r["sglang_transfer_ms"] for r in rows], "s--", label="SGLang transfer time")
    if "spin_overhead_ms" in rows[0]:
        ax.plot(xs, [r["spin_overhead_ms"] for r in rows], "x-.",
                label="same, schedulers spinning while waiting (SGLang default)")
    ax.plot(xs, [1000 * (latency + slope * x) for x in xs], ":", label="fit (emulator terms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.set_title("Real PD on CPU: KV over Mooncake TCP (SmolLM2-135M fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--write-profile", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-spin", action="store_true",
                        help="also run a PD pair whose schedulers spin while waiting (SGLang's "
                             "own behaviour, OMNIINFER_CPU_PD_POLL_MS=0), interleaved")
    args = parser.parse_args(argv)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    rng = random.Random(args.seed)
    random.seed(args.seed)
    max_tokens = max(16384, 2 * max(args.lengths) + 64)
    logs = Path(tempfile.mkdtemp(prefix="pd-transfer-"))
    # --enable-metrics: SGLang records per-request time stats only then, and with them the
    # prefill server's last transfer time and speed in /v1/loads.
    metrics = ["--enable-metrics"]
    servers = [pd_server(args.model, "prefill", logs, max_tokens, metrics),
               pd_server(args.model, "decode", logs, max_tokens, metrics),
               plain_server(args.model, logs, max_tokens)]
    if args.compare_spin:
        spinning = [pd_server(args.model, "prefill", logs, max_tokens, metrics, "spin-prefill"),
                    pd_server(args.model, "decode", logs, max_tokens, metrics, "spin-decode")]
        for server in spinning:
            server.env[PD_POLL_MS_ENV] = "0"
        servers += spinning
    load_before = os.getloadavg()[0]
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in args.lengths}
    print(f"[transfer] starting prefill, decode and plain servers (logs: {logs})")
    with started(servers), concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill, decode, plain = servers[:3]
        pairs = {"pd": (prefill, decode)}
        if args.compare_spin:
            pairs["spin"] = (servers[3], servers[4])
        # The CPU engine pays a one-off cost for each new batch shape: run every length once on
        # both paths before timing anything.
        for n in tqdm(args.lengths, desc="warm-up", unit="len"):
            warm = [rng.randrange(1000, 40000) for _ in range(n)]
            for p, d in pairs.values():
                measure_pd(p, d, warm, pool)
            _post(plain.base_url + "/generate", _body(warm, 1, True), True)
        plan = [(n, r) for r in range(args.repeats) for n in args.lengths]
        for i, (n, _r) in enumerate(tqdm(plan, desc="prompts", unit="req")):
            ids = [rng.randrange(1000, 40000) for _ in range(n)]
            paths = ["plain", *pairs]
            shift = i % len(paths)  # rotate which path goes first
            got: dict[str, Any] = {}
            for path in paths[shift:] + paths[:shift]:
                if path == "plain":
                    got[path], _ = _post(plain.base_url + "/generate", _body(ids, 1, True), True)
                else:
                    got[path] = measure_pd(*pairs[path], ids, pool)
            sample = {**got["pd"], "plain_ttft_s": got["plain"],
                      "overhead_s": got["pd"]["pd_ttft_s"] - got["plain"]}
            if "spin" in got:
                sample["spin_pd_ttft_s"] = got["spin"]["pd_ttft_s"]
                sample["spin_overhead_s"] = got["spin"]["pd_ttft_s"] - got["plain"]
            samples[n].append(sample)
    bytes_per_token = kv_bytes_per_token(PROFILE)
    rows = []
    for n in args.lengths:
        s = samples[n]
        rows.append({
            "tokens": n, "kv_mib": n * bytes_per_token / 2**20,
            "plain_ttft_ms": 1000 * statistics.median(x["plain_ttft_s"] for x in s),
            "pd_ttft_ms": 1000 * statistics.median(x["pd_ttft_s"] for x in s),
            "overhead_ms": 1000 * statistics.median(x["overhead_s"] for x in s),
            "overhead_spread_ms": 1000 * (max(x["overhead_s"] for x in s)
                                          - min(x["overhead_s"] for x in s)),
            "sglang_transfer_ms": statistics.median(x["sglang_transfer_ms"] for x in s),
            "sglang_speed_gb_s": statistics.median(x["sglang_speed_gb_s"] for x in s),
        })
        if args.compare_spin:
            rows[-1]["spin_pd_ttft_ms"] = 1000 * statistics.median(x["spin_pd_ttft_s"] for x in s)
            rows[-1]["spin_overhead_ms"] = 1000 * statistics.median(
                x["spin_overhead_s"] for x in s)
    latency, slope = fit_line([float(r["tokens"]) for r in rows],
                              [r["overhead_ms"] / 1000 for r in rows])
    latency = max(latency, 0.0)
    bandwidth = bytes_per_token / slope / 1e9 if slope > 0 else float("inf")
    t_latency, t_slope = fit_line([float(r["tokens"]) for r in rows],
                                  [r["sglang_transfer_ms"] / 1000 for r in rows])
    transfer_bandwidth = bytes_per_token / t_slope / 1e9 if t_slope > 0 else float("inf")
    when = time.strftime("%Y-%m-%d")
    print(f"\n{'tokens':>7} {'KV MiB':>7} {'plain TTFT':>11} {'PD TTFT':>9} {'overhead':>9} "
          f"{'spread':>7} {'SGLang xfer':>12} {'GB/s':>6}"
          + (f" {'spinning PD TTFT':>17}" if args.compare_spin else ""))
    for r in rows:
        print(f"{r['tokens']:>7} {r['kv_mib']:>7.1f} {r['plain_ttft_ms']:>9.0f}ms "
              f"{r['pd_ttft_ms']:>7.0f}ms {r['overhead_ms']:>7.0f}ms {r['overhead_spread_ms']:>5.0f}ms"
              f" {r['sglang_transfer_ms']:>10.1f}ms {r['sglang_speed_gb_s']:>6.2f}"
              + (f" {r['spin_pd_ttft_ms']:>15.0f}ms" if args.compare_spin else ""))
    print(f"\nfit of the PD overhead: latency {latency * 1000:.1f} ms + "
          f"{slope * 1e6:.2f} us/token  ->  bandwidth {bandwidth:.3g} GB/s "
          f"({bytes_per_token} KV bytes per token)")
    print(f"fit of SGLang's transfer time: {t_latency * 1000:.1f} ms + {t_slope * 1e6:.2f} us/token"
          f"  ->  {transfer_bandwidth:.3g} GB/s")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "date": when, "model": args.model.name, "servers": "1 prefill + 1 decode + 1 plain, CPU",
        "transfer_backend": "mooncake_tcp", "kv_bytes_per_token": bytes_per_token,
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "rows": rows, "samples": {str(n): samples[n] for n in args.lengths},
        "fit_overhead": {"latency_s": latency, "seconds_per_token": slope,
                         "bandwidth_gb_s": bandwidth},
        "fit_sglang_transfer": {"latency_s": t_latency, "seconds_per_token": t_slope,
                                "bandwidth_gb_s": transfer_bandwidth},
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    (args.out / "transfer.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, latency, slope, args.out / "transfer.png")
    print(f"wrote {args.out / 'transfer.json'} and transfer.png")
    if args.write_profile:
        if bandwidth == float("inf"):
            print("the overhead does not grow with the prompt: profile left as it is")
        else:
            write_profile(PROFILE, bandwidth, latency, when)
            print(f"wrote the fitted transfer terms into {PROFILE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
