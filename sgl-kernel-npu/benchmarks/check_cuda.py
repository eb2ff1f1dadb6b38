"""Check the OmniAttn sink + recent decode kernel on a CUDA GPU and time it against full attention.

With a CUDA device: compiles and runs every kernel variant, verifies them against the PyTorch
reference (small random paged inputs, then the benchmark shape itself), reports what the
kernels were compiled for (target, assembly kinds, PTX ``.target``), and times sink + recent
decode against full decode (the same Triton kernel over all tokens, and torch SDPA) with a
cold L2. Results go to ``check_cuda_result.json`` beside this script (``--out`` to change).

Without one: runs a small correctness check under ``TRITON_INTERPRET=1`` on CPU and says that
no CUDA device was found. Exit status is non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # kernel_bench, also when this file is loaded by path

import kernel_bench as kb  # noqa: E402

NO_GPU_LINE = "no CUDA device: ran the interpreter correctness check only"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=384)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", type=Path, default=HERE / "check_cuda_result.json")
    p.add_argument("--interpret", action="store_true",
                   help="force the CPU interpreter check even when a GPU is present")
    p.add_argument("--aot", action="store_true",
                   help="without a GPU, also compile the kernels to PTX/cubin for sm_90")
    return p.parse_args(argv)


def correctness_cases(device: str) -> list[dict[str, Any]]:
    """Small random paged cases over every kernel variant; each row says pass or fail."""
    m = kb.import_kernels()
    kernels, reference, indices, testing = m.dec, m.ref, m.idx, m.testing
    sink, recent = 4, 8
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
    variants = [("head", torch.float32), ("grouped", torch.float16)]
    if device == "cuda":
        variants += [("head", torch.float16), ("head", torch.bfloat16), ("grouped", torch.bfloat16)]
    # The interpreter runs every program in Python: keep the CPU shapes tiny.
    heads, dim = (8, 32) if device == "cuda" else (4, 16)
    rows = []
    for impl, dtype in variants:
        inp = testing.make_paged_inputs([3, 12, 13, 40], heads, 2, dim, page_size=4,
                                        dtype=dtype, device=device, max_context=48, seed=1)
        ref = reference.decode_sink_recent_reference(*inp.args(), sink, recent)
        full_ref = reference.decode_full_reference(*inp.args())
        checks = {"direct": kernels.decode_sink_recent(*inp.args(), sink, recent, impl=impl,
                                                       num_kv_splits=2)}
        if device == "cuda" or impl == "head":  # the interpreter is slow: one variant each
            checks["full_kernel_vs_full_ref"] = kernels.decode_full(*inp.args(), impl=impl)
            indptr, idx = indices.build_kv_indices(inp.req_to_token, inp.req_pool_indices,
                                                   inp.seq_lens, sink, recent)
            checks["indexed"] = kernels.decode_paged_indices(inp.q, inp.k_buffer, inp.v_buffer,
                                                             indptr, idx, impl=impl)
        for name, out in checks.items():
            err = kb.max_err(out, full_ref if name.startswith("full") else ref)
            rows.append({"impl": impl, "dtype": str(dtype).removeprefix("torch."),
                         "case": name, "max_abs_err": err, "ok": err <= tol[dtype]})
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> bool:
    for r in rows:
        print(f"  {r['impl']:8s} {r['dtype']:9s} {r['case']:24s} err={r['max_abs_err']:.2e} "
              f"{'ok' if r['ok'] else 'FAIL'}")
    return all(r["ok"] for r in rows)


def _dense_kv(inp: Any, positions: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Gather each request's chosen tokens into dense [B, Hkv, n, D] K/V for SDPA (untimed)."""
    ks, vs = [], []
    for b in range(inp.q.shape[0]):
        pos = positions(int(inp.seq_lens[b])).to(inp.req_to_token.device)
        slots = inp.req_to_token[int(inp.req_pool_indices[b]), pos].long()
        ks.append(inp.k_buffer[slots].transpose(0, 1))
        vs.append(inp.v_buffer[slots].transpose(0, 1))
    return torch.stack(ks), torch.stack(vs)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with grouped kv heads; torch < 2.5 has no enable_gqa, so expand the heads there."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        return sdpa(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:
        group = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale)


def benchmark(args: argparse.Namespace, device: str = "cuda") -> dict[str, Any]:
    """Correctness at the benchmark shape, then timings; returns the JSON-able result."""
    m = kb.import_kernels()
    kernels, reference, indices, testing = m.dec, m.ref, m.idx, m.testing
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lens = [args.context] * args.batch
    inp = testing.make_paged_inputs(lens, args.q_heads, args.kv_heads, args.head_dim,
                                    page_size=args.page_size, dtype=dtype, device=device,
                                    max_context=args.context)
    sink, recent = args.sink, args.recent
    indptr, idx = indices.build_kv_indices(inp.req_to_token, inp.req_pool_indices,
                                           inp.seq_lens, sink, recent)
    kept = indices.kept_count(args.context, sink, recent)
    runs: dict[str, Callable[[], Any]] = {
        "omni_grouped": lambda: kernels.decode_sink_recent(*inp.args(), sink, recent,
                                                           impl="grouped"),
        "omni_head": lambda: kernels.decode_sink_recent(*inp.args(), sink, recent, impl="head"),
        "omni_indexed_grouped": lambda: kernels.decode_paged_indices(
            inp.q, inp.k_buffer, inp.v_buffer, indptr, idx, max_kept=kept, impl="grouped"),
        "omni_build_indices_host": lambda: indices.build_kv_indices(
            inp.req_to_token, inp.req_pool_indices, inp.seq_lens, sink, recent),
        "full_triton_grouped": lambda: kernels.decode_full(*inp.args(), impl="grouped"),
        "full_triton_head": lambda: kernels.decode_full(*inp.args(), impl="head"),
    }
    ref = reference.decode_sink_recent_reference(*inp.args(), sink, recent)
    full_ref = reference.decode_full_reference(*inp.args())
    errors = {name: kb.max_err(runs[name](), full_ref if name.startswith("full") else ref)
              for name in runs if name != "omni_build_indices_host"}
    compiled = kb.compile_report(kernels)

    scale = 1.0 / math.sqrt(args.head_dim)
    q4 = inp.q.unsqueeze(2)  # [B, Hq, 1, D]
    for label, keep in (("sdpa_full_dense", None), ("sdpa_sink_recent_dense", (sink, recent))):
        def pick(n: int, keep: tuple[int, int] | None = keep) -> torch.Tensor:
            return torch.arange(n) if keep is None else indices.kept_positions(n, *keep)

        k4, v4 = _dense_kv(inp, pick)

        def sdpa(k4: torch.Tensor = k4, v4: torch.Tensor = v4) -> torch.Tensor:
            return _sdpa_gqa(q4, k4, v4, scale)

        runs[label] = sdpa
        errors[label] = kb.max_err(sdpa().squeeze(2), full_ref if keep is None else ref)
    for splits in (1, 2, 4, 8):  # how the split count moves the sink + recent kernel
        runs[f"omni_grouped_splits{splits}"] = lambda n=splits: kernels.decode_sink_recent(
            *inp.args(), sink, recent, impl="grouped", num_kv_splits=n)
    timings = {}
    timer = kb.make_timer(device)
    for name, fn in runs.items():
        timings[name] = timer(fn, args.iters, args.warmup)
        timings[name]["graph_ms"] = kb.graph_ms(fn)
    base = timings["full_triton_grouped"]["median_ms"]
    elem = inp.k_buffer.element_size()
    for name, t in timings.items():
        tokens = args.context if "full" in name else kept
        kv_bytes = 2 * args.batch * args.kv_heads * tokens * args.head_dim * elem
        t["speedup_vs_full_triton_grouped"] = base / t["median_ms"]
        if name != "omni_build_indices_host":
            t["kv_gbps"] = kv_bytes / (t["median_ms"] * 1e-3) / 1e9
    return {"errors": errors, "compiled": compiled, "timings": timings, "kept_tokens": kept}


def _offline_cuda_compile() -> bool:
    """Lower the kernels for sm_90 on the host; needs a fresh process without the interpreter."""
    paths = [str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in paths if p))
    print("offline CUDA compile (no device needed):")
    proc = subprocess.run([sys.executable, "-m", "omni_kernel_npu.omni_attn.aot"], env=env,
                          capture_output=True, text=True)
    print("\n".join("  " + line for line in proc.stdout.splitlines()))
    if proc.returncode:
        print(proc.stderr[-3000:])
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    gpu = torch.cuda.is_available() and not args.interpret
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"
        print("interpreter correctness check (TRITON_INTERPRET=1, CPU):")
        ok = _print_rows(correctness_cases("cpu"))
        if args.aot:
            ok = _offline_cuda_compile() and ok
        print(NO_GPU_LINE)
        return 0 if ok else 1

    print("small-shape correctness on CUDA:")
    rows = correctness_cases("cuda")
    small_ok = _print_rows(rows)
    print(f"benchmark: batch={args.batch} context={args.context} q_heads={args.q_heads} "
          f"kv_heads={args.kv_heads} head_dim={args.head_dim} sink={args.sink} "
          f"recent={args.recent} dtype={args.dtype}")
    bench = benchmark(args)
    tol = 3e-2 if args.dtype == "bf16" else 4e-3
    big_ok = all(err <= tol for err in bench["errors"].values())
    cuda_ok = bool(bench["compiled"]) and all(c["cuda"] for c in bench["compiled"].values())
    for name, c in bench["compiled"].items():
        print(f"  compiled {name}: target={c['target']} ptx={c['ptx_target']} "
              f"asm={','.join(c['asm_kinds'])} regs={c['n_regs']} spills={c['n_spills']}")
    for name, err in bench["errors"].items():
        print(f"  err {name:26s} {err:.2e}")
    for name, t in bench["timings"].items():
        gbps = f"{t['kv_gbps']:8.1f} GB/s" if "kv_gbps" in t else ""
        speedup = t["speedup_vs_full_triton_grouped"]
        graph = "  graph   n/a  " if t["graph_ms"] is None else f"  graph {t['graph_ms']:7.3f}"
        print(f"  time {name:26s} {t['median_ms']:8.3f} ms  x{speedup:6.2f}  {gbps}{graph}")
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "environment": kb.environment("cuda"), "small_cases": rows, **bench,
              "ok": {"small": small_ok, "benchmark_shape": big_ok, "compiled_for_cuda": cuda_ok}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if small_ok and big_ok and cuda_ok else 1


if __name__ == "__main__":
    sys.exit(main())
