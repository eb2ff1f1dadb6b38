"""The kernels reading a compressed layer from SGLang's hybrid KV pool, on a device.

A compressed layer's K/V live in the SWA sub-pool; ``req_to_token`` holds full-pool slots and
``slot_map`` (SGLang's ``full_to_swa_index_mapping``) translates them inside the kernel.
``testing.to_hybrid_pool`` moves a random paged pool's K/V that way (whole pages to shuffled SWA
pages, evicted tokens mapped to the pad slot, which holds NaN), so a kernel that reads an
evicted token, or reads without translating, fails the comparison.

- ``check_slot_map_correctness``: decode and extend through ``slot_map`` against the fp32
  reference on the full pool, at every context x page size; also whether the output is
  bit-identical to the same kernel without a map on the full pool (same arithmetic);
- ``time_slot_map_decode``: sink + recent decode with ``slot_map`` on the hybrid pool vs
  without on the full pool, same requests (what the translation costs).

Used by ``device_check.py``; only PyTorch, Triton and this package.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch


def _host_tables(inp: Any) -> tuple[torch.Tensor, ...]:
    """``req_to_token``, ``seq_lens``, ``req_pool_indices`` on the host, where
    ``to_hybrid_pool`` builds the map (one copy instead of a sync per request)."""
    return inp.req_to_token.cpu(), inp.seq_lens.cpu(), inp.req_pool_indices.cpu()


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max())


def check_slot_map_correctness(m: SimpleNamespace, cfg: dict[str, Any], device: str,
                               tol: float) -> list[dict[str, Any]]:
    """Decode and extend with ``slot_map`` at ``cfg["slot_map_contexts"]`` x ``cfg["pages"]``
    in ``cfg["dtype"]``."""
    rows = []
    for ctx in cfg["slot_map_contexts"]:
        for page in cfg["pages"]:
            rows += _case(m, cfg, device, ctx, page, tol)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _case(m: SimpleNamespace, cfg: dict[str, Any], device: str, ctx: int, page: int,
          tol: float) -> list[dict[str, Any]]:
    sink, recent, dt = cfg["sink"], cfg["recent"], cfg["dtype"]
    shape = (cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"])
    common = dict(page_size=page, dtype=dt, device=device, seed=3 * ctx + page,
                  max_context=ctx)
    # decode: long, long, half, and one short enough to equal full attention
    inp = m.testing.make_paged_inputs([ctx, ctx - 3, ctx // 2 + 1, min(ctx, 10)], *shape,
                                      **common)
    swa_k, swa_v, slot_map = m.testing.to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, *_host_tables(inp),
        sink, recent, page_size=page, seed=page)
    tail = (inp.req_to_token, inp.req_pool_indices, inp.seq_lens)
    out = m.dec.decode_sink_recent(inp.q, swa_k, swa_v, *tail, sink, recent, slot_map=slot_map)
    plain = m.dec.decode_sink_recent(*inp.args(), sink, recent)
    ref = m.ref.decode_sink_recent_reference(*inp.args(), sink, recent)
    rows = [_row("decode", ctx, page, dt, out, plain, ref, slot_map, tol)]
    del inp, swa_k, swa_v, slot_map, out, plain, ref
    # extend: a cached prefix + new tokens, a half-length one, a whole prompt (prefix 0); the
    # SWA pool holds the window of every new query (sink and the last recent + new - 1)
    new, whole = cfg["extend_new"], cfg["whole_prompt"]
    ext_lens = [new, new // 2 + 13, whole]
    inp = m.testing.make_extend_inputs([ctx, ctx // 2 + 5, whole], ext_lens, *shape, **common)
    swa_k, swa_v, slot_map = m.testing.to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, *_host_tables(inp),
        sink, recent + max(ext_lens), page_size=page, seed=page)
    bound = max(ext_lens)
    tail = (inp.req_to_token, inp.req_pool_indices, inp.seq_lens, inp.qo_indptr)
    out = m.ext.extend_sink_recent(inp.q, swa_k, swa_v, *tail, sink, recent,
                                   max_extend_len=bound, slot_map=slot_map)
    plain = m.ext.extend_sink_recent(*inp.args(), sink, recent, max_extend_len=bound)
    ref = m.ref.extend_sink_recent_reference(*inp.args(), sink, recent)
    rows.append(_row("extend", ctx, page, dt, out, plain, ref, slot_map, tol))
    return rows


def _row(kernel: str, ctx: int, page: int, dt: torch.dtype, out: torch.Tensor,
         plain: torch.Tensor, ref: torch.Tensor, slot_map: torch.Tensor, tol: float
         ) -> dict[str, Any]:
    finite = bool(torch.isfinite(out.float()).all())
    err = _err(out, ref)
    row = {"kernel": kernel, "context": ctx, "page_size": page,
           "dtype": str(dt).removeprefix("torch."), "err": err, "tol": tol, "finite": finite,
           "err_unmapped_full_pool": _err(plain, ref),
           "identical_to_unmapped": bool(torch.equal(out, plain)),
           "evicted_slots": int((slot_map == 0).sum()), "slots": int(slot_map.numel()),
           "ok": finite and err <= tol and out.dtype == dt}
    print(f"  slot_map {kernel:6s} ctx={ctx:6d} page={page:2d}: err {err:.2e} "
          f"(unmapped {row['err_unmapped_full_pool']:.2e}, identical "
          f"{row['identical_to_unmapped']}) {'ok' if row['ok'] else 'FAIL'}")
    return row


def time_slot_map_decode(m: SimpleNamespace, cfg: dict[str, Any], device: str,
                         timer: Callable[..., dict[str, float]],
                         graph: Callable[[Callable[[], Any]], float | None] | None
                         ) -> dict[str, Any]:
    """Sink + recent decode at ``cfg["slot_map_timing_context"]``, batch
    ``cfg["decode_batch"]``: without a map on the full pool vs with ``slot_map`` on the hybrid
    pool (same requests, same page size)."""
    ctx, page = cfg["slot_map_timing_context"], cfg["timing_page"]
    sink, recent = cfg["sink"], cfg["recent"]
    inp = m.testing.make_paged_inputs(
        [ctx] * cfg["decode_batch"], cfg["q_heads"], cfg["kv_heads"], cfg["head_dim"],
        page_size=page, dtype=cfg["dtype"], device=device, seed=ctx + 1, max_context=ctx)
    swa_k, swa_v, slot_map = m.testing.to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, *_host_tables(inp),
        sink, recent, page_size=page, seed=1)
    tail = (inp.req_to_token, inp.req_pool_indices, inp.seq_lens)
    runs = {
        "no_map": lambda: m.dec.decode_sink_recent(*inp.args(), sink, recent),
        "slot_map": lambda: m.dec.decode_sink_recent(inp.q, swa_k, swa_v, *tail, sink, recent,
                                                     slot_map=slot_map),
    }
    row: dict[str, Any] = {"context": ctx, "batch": cfg["decode_batch"], "page_size": page,
                           "slot_map_dtype": str(slot_map.dtype).removeprefix("torch."),
                           "identical": bool(torch.equal(runs["no_map"](), runs["slot_map"]()))}
    for _ in range(2):  # interleaved twice; the medians of the second pass are reported
        for name, fn in runs.items():
            row[name] = timer(fn, cfg["iters"], cfg["warmup"])
    if graph is not None:
        for name, fn in runs.items():
            row[name]["graph_ms"] = graph(fn)
    row["overhead_per_call"] = row["slot_map"]["median_ms"] / row["no_map"]["median_ms"]
    g = row["no_map"].get("graph_ms"), row["slot_map"].get("graph_ms")
    if g[0] and g[1]:
        row["overhead_in_graph"] = g[1] / g[0]
    print(f"  decode ctx={ctx} b={cfg['decode_batch']} page={page}: no map "
          f"{row['no_map']['median_ms']:.4f} ms, slot_map {row['slot_map']['median_ms']:.4f} ms "
          f"(x{row['overhead_per_call']:.3f})"
          + (f"; graph {g[0]:.4f} vs {g[1]:.4f} ms (x{row['overhead_in_graph']:.3f})"
             if "overhead_in_graph" in row else ""))
    return row
