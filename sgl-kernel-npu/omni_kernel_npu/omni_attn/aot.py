"""Compile the decode kernels for a GPU target with no GPU present (``triton.compile``).

Triton lowers a kernel to TTIR, TTGIR, LLVM IR, PTX and (through the ``ptxas`` it ships) a
cubin entirely on the host, so a CPU-only machine can still prove that the compiled path — not
just the interpreter — accepts the kernels, with the argument types a real launch would use.
Must run with ``TRITON_INTERPRET`` unset or 0 (the interpreter replaces the JIT functions).

    python -m omni_kernel_npu.omni_attn.aot [--arch 90] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import triton

from . import decode_sink_recent as k
from . import extend_sink_recent as e

_POINTERS = {"SeqLens": "*i64", "ReqPoolIdx": "*i64", "ReqToToken": "*i32", "KvIndptr": "*i32",
             "KvIndices": "*i64", "MidO": "*fp32", "MidLse": "*fp32", "QoIndptr": "*i32", "SlotMap": "*i64"}
_SCALARS = {"sm_scale": "fp32", "logit_cap": "fp32", "sink": "i32", "recent": "i32"}


def _source(fn: Any, dtype: str, constexprs: dict[str, Any]) -> Any:
    """ASTSource with the types a launch from the wrappers gives each argument."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = f"*{dtype}"
        elif name.startswith("stride_"):
            signature[name] = "i32"
        else:
            signature[name] = _POINTERS.get(name) or _SCALARS[name]
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def compile_kernels(arch: int = 90, head_dim: int = 128, group: int = 4) -> dict[str, Any]:
    """Compile the decode (head, grouped, merge) and extend (tl.dot and fp32 vector) kernels for
    ``cuda:sm_<arch>``; report per kernel."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", arch, 32)
    block = triton.next_power_of_2(head_dim)
    dims = dict(DK=head_dim, DV=head_dim, BLOCK_DK=block, BLOCK_DV=block,
                BLOCK_N=k.DEFAULT_BLOCK_N, NUM_SPLITS=4)
    jobs = {
        # fp32 vector kernel through the explicit index list, with the logit cap
        "stage1_head_fp32_indexed_cap": (k._stage1_head, "fp32", dict(
            dims, GROUP=group, HAS_CAP=True, INDEXED=True, HAS_MAP=False)),
        # bf16 tl.dot kernel with the in-kernel sink/recent window
        "stage1_grouped_bf16": (k._stage1_grouped, "bf16", dict(
            dims, GROUP=group, HEADS_PER_TILE=min(k.BLOCK_H, group),
            TILES_PER_KV=triton.cdiv(group, min(k.BLOCK_H, group)), BLOCK_H=k.BLOCK_H,
            HAS_CAP=False, INDEXED=False, DOT_FP32=False, HAS_MAP=True)),
        "stage2_merge_bf16": (k._stage2_merge, "bf16", dict(
            DV=head_dim, BLOCK_DV=block, NUM_SPLITS=4, BLOCK_S=4)),
        # extend: bf16 tl.dot blocks, and the fp32 broadcast path with the logit cap
        "extend_dot_bf16": (e._extend_kernel, "bf16", dict(
            GROUP=group, DK=head_dim, DV=head_dim, BLOCK_M=e.DEFAULT_BLOCK_M,
            BLOCK_N=e.DEFAULT_BLOCK_N, BLOCK_DK=block, BLOCK_DV=block, HAS_CAP=False,
            USE_DOT=True, DOT_FP32=False, HAS_MAP=True)),
        "extend_vector_fp32_cap": (e._extend_kernel, "fp32", dict(
            GROUP=group, DK=head_dim, DV=head_dim, BLOCK_M=e.FP32_BLOCK, BLOCK_N=e.FP32_BLOCK,
            BLOCK_DK=block, BLOCK_DV=block, HAS_CAP=True, USE_DOT=False, DOT_FP32=False,
            HAS_MAP=False)),
    }
    report = {}
    for name, (fn, dtype, constexprs) in jobs.items():
        start = time.perf_counter()
        compiled = triton.compile(_source(fn, dtype, constexprs), target=target,
                                  options={"num_warps": 4})
        ptx = compiled.asm.get("ptx", "")
        found = re.search(r"^\s*\.target\s+(\S+)", ptx, re.M)
        report[name] = {
            "target": str(compiled.metadata.target),
            "asm_kinds": sorted(compiled.asm.keys()),
            "ptx_target": found.group(1) if found else None,
            "shared_bytes": compiled.metadata.shared,
            # fp32 kernels must have none: CUDA runs an fp32 tt.dot as TF32
            "tt_dot_ops": compiled.asm.get("ttir", "").count("tt.dot "),
            "seconds": round(time.perf_counter() - start, 2),
        }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = compile_kernels(arch=args.arch)
    if args.json:
        print(json.dumps(report))
    else:
        for name, r in report.items():
            print(f"{name}: {r['target']} ptx={r['ptx_target']} asm={','.join(r['asm_kinds'])}")
    return 0 if all("cubin" in r["asm_kinds"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
