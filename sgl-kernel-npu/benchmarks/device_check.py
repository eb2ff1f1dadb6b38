"""One device check for OmniAttn and OmniPlacement on a GPU, sized to fit a short device lease.

Needs only PyTorch and Triton (no SGLang); runs from a plain checkout. Steps:

a. correctness: the sink + recent decode and extend kernels (and the same kernels with a full
   window) against the fp32 PyTorch references at several contexts and page sizes 1/16/64,
   plus what each kernel was compiled for (a cubin must exist);
b. attention timings: compressed-layer decode against full attention over the same context
   (same Triton kernel with a full window; torch SDPA over dense K/V as a lower bound), and
   compressed vs full extend at one shape; CUDA events, warm-up, medians, L2 flushed first;
c. placement staging: a GEMM "forward" alone, then while expert weights are copied host
   (pinned) -> device and device -> device on a side stream whose event the consumer waits
   on, versus the same copies on the forward's own stream; staged weights are verified;
d. hybrid pool (``hybrid_pool_check.py``): decode and extend reading a compressed layer from
   the SWA sub-pool through ``slot_map`` (SGLang's ``full_to_swa_index_mapping``) against the
   reference, and decode with vs without the map (timed with the attention timings);
e. the placement runtime's own staging code (``placement_staging_check.py``): imports
   ``omniinfer.platform`` and ``omniinfer.placement.staging`` from ``python/`` (no SGLang),
   stages experts through ``SlotStager`` on its stream beside the forward, switches them in
   with ``StagedWeights.switch_in`` and checks them, vs the same stager on the forward's
   stream; ``HostCopy`` of activation counts without a host sync.

Writes a JSON (``--out``) and prints a table; exits non-zero when a correctness check fails.
A wall-clock budget (``--budget-s``) skips the timings left once it is spent and says so;
``--steps`` runs a subset.
``--dry-run`` runs every step on CPU with tiny shapes under the Triton interpreter (plain
copies, no streams) in seconds; CI runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kernel_bench as kb
import torch

HERE = Path(__file__).resolve().parent
GPU = dict(contexts=[2048, 8192, 32768], pages=[1, 16, 64], q_heads=32, kv_heads=8,
           head_dim=128, sink=128, recent=384, dtype=torch.bfloat16, extend_new=128,
           whole_prompt=600, decode_batch=32, timing_page=16, extend_shape=(2, 16384, 2048),
           iters=100, warmup=20, gemm=(4096, 4096, 8192), forward_ms=15.0,
           expert_shape=(2048, 4096), experts_h2d=12, experts_d2d=12, staging_reps=20,
           slot_map_contexts=[8192, 32768], slot_map_timing_context=32768, stage_layers=4,
           stage_slots_per_rank=16, stage_expert=(4096, 1024), stage_local=2, stage_remote=2,
           stage_send=1, counts_shape=(61, 288))
DRY = dict(contexts=[40, 96], pages=[1, 16, 64], q_heads=4, kv_heads=2, head_dim=16, sink=4,
           recent=12, dtype=torch.bfloat16, extend_new=8, whole_prompt=24, decode_batch=2,
           timing_page=16, extend_shape=(2, 96, 24), iters=2, warmup=1, gemm=(64, 64, 64),
           forward_ms=0.0, expert_shape=(32, 64), experts_h2d=2, experts_d2d=2,
           staging_reps=2, slot_map_contexts=[40, 96], slot_map_timing_context=96,
           stage_layers=2, stage_slots_per_rank=8, stage_expert=(32, 16), stage_local=2,
           stage_remote=2, stage_send=1, counts_shape=(3, 8))
STEPS = ("correctness", "slot_map", "timings", "staging", "placement")
# max abs error against the fp32 reference (outputs are averages of N(0, 1) values)
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}


class Budget:
    """Wall-clock guard: timings are skipped, and listed, once ``limit_s`` has passed."""

    def __init__(self, limit_s: float) -> None:
        self.start = time.monotonic()
        self.limit_s = limit_s
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def allows(self, step: str) -> bool:
        if self.elapsed() < self.limit_s:
            return True
        self.skipped.append(f"{step} (budget {self.limit_s:.0f} s spent)")
        print(f"  skipped {step}: wall-clock budget spent")
        return False


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="every step on CPU, tiny shapes, Triton interpreter")
    p.add_argument("--out", type=Path, default=HERE / "device_check.json")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="skip the timings left after this many seconds")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"comma-separated subset of {','.join(STEPS)} (default: all)")
    args = p.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = set(args.steps) - set(STEPS)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; choose from {','.join(STEPS)}")
    return args


def _modules(dry: bool) -> SimpleNamespace:
    """Pick the interpreter (dry run) or the compiler, then import the kernels."""
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    return kb.import_kernels()


# ---------------------------------------------------------------- a. correctness


def check_correctness(m: SimpleNamespace, cfg: dict[str, Any], device: str
                      ) -> list[dict[str, Any]]:
    """Decode and extend, sink + recent and full window, at every context x page size in bf16,
    then fp32 and fp16 at the smallest context (their own compiled variants); the sink + recent
    output must also differ from full attention (something was evicted)."""
    cases = [(ctx, page, cfg["dtype"]) for ctx in cfg["contexts"] for page in cfg["pages"]]
    cases += [(cfg["contexts"][0], 16, dt) for dt in (torch.float32, torch.float16)]
    return [row for case in cases for row in _check_case(m, cfg, device, *case)]


def _check_case(m: SimpleNamespace, cfg: dict[str, Any], device: str, ctx: int, page: int,
                dt: torch.dtype) -> list[dict[str, Any]]:
    sink, recent = cfg["sink"], cfg["recent"]
    shape = (cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"])
    common = dict(page_size=page, dtype=dt, device=device, seed=ctx + page, max_context=ctx)
    tag = (ctx, page, dt)
    # decode: long, long, half, and one short enough to equal full attention
    inp = m.testing.make_paged_inputs([ctx, ctx - 3, ctx // 2 + 1, min(ctx, 10)], *shape,
                                      **common)
    rows = [_row("decode", *tag, m.dec.decode_sink_recent(*inp.args(), sink, recent),
                 m.ref.decode_sink_recent_reference(*inp.args(), sink, recent),
                 m.dec.decode_full(*inp.args()), m.ref.decode_full_reference(*inp.args()))]
    del inp
    # extend: a cached prefix + new tokens, a half-length one, a whole prompt (prefix 0)
    new, whole = cfg["extend_new"], cfg["whole_prompt"]
    ext_lens = [new, new // 2 + 13, whole]
    inp = m.testing.make_extend_inputs([ctx, ctx // 2 + 5, whole], ext_lens, *shape, **common)
    bound = max(ext_lens)
    rows.append(_row(
        "extend", *tag,
        m.ext.extend_sink_recent(*inp.args(), sink, recent, max_extend_len=bound),
        m.ref.extend_sink_recent_reference(*inp.args(), sink, recent),
        m.ext.extend_full(*inp.args(), max_extend_len=bound),
        m.ref.extend_sink_recent_reference(*inp.args(), 0, ctx)))
    return rows


def _row(kernel: str, ctx: int, page: int, dt: torch.dtype, out: torch.Tensor,
         ref: torch.Tensor, full: torch.Tensor, full_ref: torch.Tensor) -> dict[str, Any]:
    tol = TOL[dt]
    err, full_err = kb.max_err(out, ref), kb.max_err(full, full_ref)
    gap = kb.max_err(out, full_ref)
    ok = (err <= tol and full_err <= tol and gap > 0.09 and out.dtype == dt
          and bool(torch.isfinite(out).all()))
    return {"kernel": kernel, "context": ctx, "page_size": page,
            "dtype": str(dt).removeprefix("torch."), "err_sink_recent": err,
            "err_full_window": full_err, "gap_to_full": gap, "tol": tol, "ok": ok}


def compile_summary(m: SimpleNamespace) -> dict[str, Any]:
    """Target, assembly kinds and registers of every launched kernel."""
    return kb.compile_report(m.dec)


# ---------------------------------------------------------------- timing helpers


def warm_gpu(seconds: float = 0.5) -> None:
    """Run matrix products for a moment so clocks are up before the first timing (the first
    run's 2K decode, timed straight after the correctness step, read 6x its graph time)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def _sdpa_dense_decode(inp: Any, scale: float) -> Callable[[], torch.Tensor]:
    """SDPA over each request's whole context gathered into dense [B, Hkv, L, D] K/V (the
    gather is not timed): a lower bound for any paged full-attention kernel."""
    rows = inp.req_to_token[inp.req_pool_indices].long()  # all requests share one length
    k = inp.k_buffer[rows].permute(0, 2, 1, 3).contiguous()
    v = inp.v_buffer[rows].permute(0, 2, 1, 3).contiguous()
    q = inp.q.unsqueeze(2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, scale=scale, enable_gqa=True)


# ---------------------------------------------------------------- b. attention timings


def time_decode(m: SimpleNamespace, cfg: dict[str, Any], device: str, budget: Budget
                ) -> list[dict[str, Any]]:
    """Per context: sink + recent decode, the same kernel over everything, dense SDPA."""
    timer = kb.make_timer(device)
    sink, recent = cfg["sink"], cfg["recent"]
    results = []
    for ctx in cfg["contexts"]:
        if not budget.allows(f"decode timing at {ctx}"):
            continue
        inp = m.testing.make_paged_inputs(
            [ctx] * cfg["decode_batch"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"],
            page_size=cfg["timing_page"], dtype=cfg["dtype"], device=device, seed=ctx,
            max_context=ctx)
        runs = {
            "sink_recent": lambda inp=inp: m.dec.decode_sink_recent(*inp.args(), sink, recent),
            "full_triton": lambda inp=inp: m.dec.decode_full(*inp.args()),
            "full_sdpa_dense": _sdpa_dense_decode(inp, 1.0 / math.sqrt(cfg["head_dim"])),
        }
        row: dict[str, Any] = {"context": ctx, "batch": cfg["decode_batch"],
                               "page_size": cfg["timing_page"]}
        for name, fn in runs.items():
            row[name] = timer(fn, cfg["iters"], cfg["warmup"])
            if device == "cuda":
                row[name]["graph_ms"] = kb.graph_ms(fn)
        row["err_full_triton_vs_sdpa"] = kb.max_err(runs["full_triton"](),
                                                 runs["full_sdpa_dense"]().squeeze(2).float())
        base = row["sink_recent"]["median_ms"]
        row["speedup_vs_full_triton"] = row["full_triton"]["median_ms"] / base
        row["speedup_vs_sdpa_dense"] = row["full_sdpa_dense"]["median_ms"] / base
        gb = row["sink_recent"].get("graph_ms"), row["full_triton"].get("graph_ms")
        if gb[0] and gb[1]:
            row["graph_speedup_vs_full_triton"] = gb[1] / gb[0]
        results.append(row)
        print(f"  decode ctx={ctx:6d}: sink+recent {base:.3f} ms, full triton "
              f"{row['full_triton']['median_ms']:.3f} ms (x{row['speedup_vs_full_triton']:.1f}),"
              f" sdpa dense {row['full_sdpa_dense']['median_ms']:.3f} ms")
        del inp, runs
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def time_extend(m: SimpleNamespace, cfg: dict[str, Any], device: str, budget: Budget
                ) -> dict[str, Any] | None:
    """Compressed vs full extend at one shape (every request: a prefix plus ``new`` tokens);
    the compressed output is checked against the reference at that shape too."""
    if not budget.allows("extend timing"):
        return None
    batch, ctx, new = cfg["extend_shape"]
    inp = m.testing.make_extend_inputs(
        [ctx] * batch, [new] * batch, cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"],
        page_size=cfg["timing_page"], dtype=cfg["dtype"], device=device, seed=7,
        max_context=ctx)
    sink, recent = cfg["sink"], cfg["recent"]
    runs = {
        "sink_recent": lambda: m.ext.extend_sink_recent(*inp.args(), sink, recent,
                                                        max_extend_len=new),
        "full_triton": lambda: m.ext.extend_full(*inp.args(), max_extend_len=new),
    }
    err = kb.max_err(runs["sink_recent"](),
                     m.ref.extend_sink_recent_reference(*inp.args(), sink, recent))
    timer = kb.make_timer(device)
    row: dict[str, Any] = {"batch": batch, "context": ctx, "new_tokens": new,
                           "page_size": cfg["timing_page"], "err_sink_recent": err,
                           "ok": err <= TOL[cfg["dtype"]]}
    for name, fn in runs.items():
        row[name] = timer(fn, max(2, cfg["iters"] // 2), cfg["warmup"])
    row["speedup_vs_full_triton"] = (row["full_triton"]["median_ms"]
                                     / row["sink_recent"]["median_ms"])
    print(f"  extend b={batch} ctx={ctx} new={new}: sink+recent "
          f"{row['sink_recent']['median_ms']:.3f} ms, full {row['full_triton']['median_ms']:.3f}"
          f" ms (x{row['speedup_vs_full_triton']:.1f}), err {err:.1e}")
    return row


# ---------------------------------------------------------------- c. placement staging


def time_staging(cfg: dict[str, Any], device: str, budget: Budget) -> dict[str, Any] | None:
    """Forward alone, with the expert copies on a side stream, with them on its own stream."""
    if not budget.allows("staging"):
        return None
    from staging_check import run_staging

    return run_staging(cfg, device)


# ---------------------------------------------------------------- d. hybrid pool (slot_map)


def check_slot_map(m: SimpleNamespace, cfg: dict[str, Any], device: str
                   ) -> list[dict[str, Any]]:
    """Decode and extend through ``slot_map`` on a hybrid pool vs the reference."""
    from hybrid_pool_check import check_slot_map_correctness

    return check_slot_map_correctness(m, cfg, device, TOL[cfg["dtype"]])


def time_slot_map(m: SimpleNamespace, cfg: dict[str, Any], device: str, budget: Budget
                  ) -> dict[str, Any] | None:
    """Sink + recent decode with vs without ``slot_map`` at the largest context."""
    if not budget.allows("slot_map decode timing"):
        return None
    from hybrid_pool_check import time_slot_map_decode

    row = time_slot_map_decode(m, cfg, device, kb.make_timer(device),
                               kb.graph_ms if device == "cuda" else None)
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- e. placement runtime code


def time_placement(cfg: dict[str, Any], device: str, budget: Budget) -> dict[str, Any] | None:
    """SlotStager / switch_in / HostCopy from ``python/omniinfer`` beside a GEMM forward."""
    if not budget.allows("placement runtime staging"):
        return None
    from placement_staging_check import run_placement_staging

    return run_placement_staging(cfg, device)


# ---------------------------------------------------------------- report


def _case_row(r: dict[str, Any], middle: str) -> str:
    """One correctness row: the case, what was measured, the verdict."""
    return (f"  {r['kernel']:7s} {r['context']:7d} {r['page_size']:4d} {r['dtype']:8s} {middle}"
            f" {'ok' if r['ok'] else 'FAIL'}")


def _slowdowns(s: dict[str, Any]) -> str:
    """How much the forward slows down with the copies on a side stream or on its own."""
    return (f"side stream x{s['slowdown_side_stream']:.3f}, "
            f"same stream x{s['slowdown_same_stream']:.3f}")


def print_table(result: dict[str, Any]) -> None:
    """The human summary: correctness rows, speedups, staging slowdowns, verdicts."""
    print("\ncorrectness (max abs error vs fp32 reference; gap: sink+recent vs full):")
    print(f"  {'kernel':7s} {'context':>7s} {'page':>4s} {'dtype':8s} {'sink+recent':>11s} "
          f"{'full':>9s} {'gap':>7s}")
    for r in result["correctness"]:
        print(_case_row(r, f"{r['err_sink_recent']:11.2e} {r['err_full_window']:9.2e} "
                           f"{r['gap_to_full']:7.3f} "))
    if result["slot_map"]:
        print("\nhybrid pool through slot_map (max abs error vs fp32 reference on the full pool):")
        for r in result["slot_map"]:
            print(_case_row(r, f"{r['err']:11.2e}  identical to unmapped: "
                               f"{r['identical_to_unmapped']} "))
    if result["decode"]:
        print("\ndecode (batch, median ms, cold L2; speedup = full / sink+recent):")
        for r in result["decode"]:
            print(f"  ctx {r['context']:6d}: sink+recent {r['sink_recent']['median_ms']:8.3f}  "
                  f"full triton {r['full_triton']['median_ms']:8.3f}  "
                  f"sdpa dense {r['full_sdpa_dense']['median_ms']:8.3f}  "
                  f"x{r['speedup_vs_full_triton']:.1f} (vs sdpa x{r['speedup_vs_sdpa_dense']:.1f})"
                  + (f"  graph: {r['sink_recent']['graph_ms']:.3f} vs "
                     f"{r['full_triton']['graph_ms']:.3f} x{r['graph_speedup_vs_full_triton']:.1f}"
                     if "graph_speedup_vs_full_triton" in r else ""))
    if result["extend"]:
        e = result["extend"]
        print(f"\nextend b={e['batch']} ctx={e['context']} new={e['new_tokens']}: sink+recent "
              f"{e['sink_recent']['median_ms']:.3f} ms, full {e['full_triton']['median_ms']:.3f} "
              f"ms, x{e['speedup_vs_full_triton']:.1f}")
    t = result["slot_map_timing"]
    if t:
        print(f"\ndecode ctx {t['context']} b={t['batch']}: no map {t['no_map']['median_ms']:.4f}"
              f" ms, slot_map {t['slot_map']['median_ms']:.4f} ms, x{t['overhead_per_call']:.3f}"
              + (f" (graph x{t['overhead_in_graph']:.3f})" if "overhead_in_graph" in t else ""))
    if result["staging"]:
        s = result["staging"]
        print(f"\nstaging ({s['staged_mb']:.1f} MB of experts, forward "
              f"{s['forward_alone_ms']:.2f} ms): {_slowdowns(s)}, intact: {s['intact']}")
    p = result["placement"]
    if p and "staging" in p:
        s, h = p["staging"], p["host_copy"]
        print(f"\nSlotStager ({s['staged_mb']:.0f} MB staged + {s['sent_mb']:.0f} MB sent, "
              f"forward {s['forward_alone_ms']:.2f} ms): {_slowdowns(s)}, "
              f"switch_in {s['switch_in_ms']:.3f} ms, intact: {s['intact']}")
        print(f"HostCopy {h['shape']}: start {h['start_host_ms']:.3f} ms on the host, pending "
              f"after start {h['event_pending_after_start']:.0%}, blocking .cpu() "
              f"{h['blocking_cpu_host_ms']:.2f} ms, ok: {h['ok']}")
    elif p:
        print(f"\nplacement imports failed: {p['imports']}")
    for step in result["skipped"]:
        print(f"skipped: {step}")
    print(f"\nverdicts: {json.dumps(result['targets'])}  ok: {result['ok']}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    budget = Budget(args.budget_s)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU interpreter version")
        return 2
    device = "cpu" if args.dry_run else "cuda"
    cfg = DRY if args.dry_run else GPU
    m = _modules(args.dry_run)
    print(f"device check on {device} ({'dry run, interpreter' if args.dry_run else 'compiled'})")
    steps = set(args.steps)
    rows: list[dict[str, Any]] = []
    slot_rows: list[dict[str, Any]] = []
    if "correctness" in steps:
        print(f"a. correctness [{budget.elapsed():.0f} s]")
        rows = check_correctness(m, cfg, device)
        print(f"  {sum(r['ok'] for r in rows)}/{len(rows)} cases ok")
    if "slot_map" in steps:
        print(f"d. hybrid pool through slot_map [{budget.elapsed():.0f} s]")
        slot_rows = check_slot_map(m, cfg, device)
        print(f"  {sum(r['ok'] for r in slot_rows)}/{len(slot_rows)} cases ok")
    compiled = compile_summary(m) if device == "cuda" and (rows or slot_rows) else {}
    cubins = all(c["cuda"] for c in compiled.values()) and bool(compiled)
    if compiled:
        print(f"  {len(compiled)} kernels compiled, cubins: {cubins}")
    decode: list[dict[str, Any]] = []
    extend = slot_timing = staging = placement = None
    if "timings" in steps:
        print(f"b. attention timings [{budget.elapsed():.0f} s]")
        if device == "cuda":
            warm_gpu()
        decode = time_decode(m, cfg, device, budget)
        extend = time_extend(m, cfg, device, budget)
    if "slot_map" in steps:
        if "timings" not in steps and device == "cuda":
            warm_gpu()
        slot_timing = time_slot_map(m, cfg, device, budget)
    if "staging" in steps:
        print(f"c. placement staging [{budget.elapsed():.0f} s]")
        staging = time_staging(cfg, device, budget)
    if "placement" in steps:
        print(f"e. placement runtime staging (SlotStager, switch_in, HostCopy) "
              f"[{budget.elapsed():.0f} s]")
        if device == "cuda":
            warm_gpu(0.2)
        placement = time_placement(cfg, device, budget)
    real = placement.get("staging") if placement else None
    host_copy = placement.get("host_copy") if placement else None
    at_32k = [r for r in decode if r["context"] == max(cfg["contexts"])]
    targets = {  # speed targets are reported, not enforced; meaningless on CPU
        "decode_speedup_at_max_context_ge_4": (at_32k[0]["speedup_vs_full_triton"] >= 4
                                               if at_32k and device == "cuda" else None),
        "side_stream_slowdown_le_5pct": (staging["slowdown_side_stream"] <= 1.05
                                         if staging and device == "cuda" else None),
        "slot_stager_side_stream_slowdown_le_5pct": (real["slowdown_side_stream"] <= 1.05
                                                     if real and device == "cuda" else None),
        # judged on the CUDA-graph time: per call, this kernel is bound by its launches
        # (run 3 on the H200: x0.98 per call, x1.39 in a graph)
        "slot_map_decode_overhead_le_10pct": (
            slot_timing.get("overhead_in_graph", slot_timing["overhead_per_call"]) <= 1.10
            if slot_timing and device == "cuda" else None),
    }
    imports = placement["imports"] if placement else None
    ok = {"correctness": all(r["ok"] for r in rows) if rows else None,
          "slot_map_correctness": all(r["ok"] for r in slot_rows) if slot_rows else None,
          "extend_timed_shape": extend["ok"] if extend else None,
          "slot_map_timed_identical": slot_timing["identical"] if slot_timing else None,
          "staged_weights_intact": staging["intact"] if staging else None,
          "placement_imports_without_sglang": (imports["ok"] and not imports["sglang_imported"]
                                               if imports else None),
          "slot_stager_weights_intact": real["intact"] if real else None,
          "host_copy_ok": host_copy["ok"] if host_copy else None,
          "compiled_for_cuda": cubins if device == "cuda" and compiled else None}
    result = {"environment": kb.environment(device), "dry_run": args.dry_run,
              "config": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in cfg.items()},
              "steps": args.steps, "correctness": rows, "slot_map": slot_rows,
              "compiled": compiled, "decode": decode, "extend": extend,
              "slot_map_timing": slot_timing, "staging": staging, "placement": placement,
              "targets": targets, "ok": ok, "skipped": budget.skipped,
              "wall_s": round(budget.elapsed(), 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out} after {result['wall_s']} s")
    return 0 if all(v is not False for v in ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
