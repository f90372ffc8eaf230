"""Chunk summaries (at seal time) and chunk log-masses against queries, for the query-aware policy.

A summary is the mean key of each of a few equal runs of a chunk's tokens, per layer and kv-head: the
policy estimates a chunk's attention mass from it while the chunk's keys are off the GPU. When the keys
are on the GPU the policy scores from the keys themselves: `chunk_lse` reads each candidate chunk's keys
in place from the pool, once for all of a step's recorded queries, and writes only log Σ exp(q·k/√D)
per (layer, query, head, chunk), where the torch path gathered the candidates' keys into a copy and
materialised every (query, head, key) logit in fp32 (reference.chunk_lse). Keys of an fp8 pool are
widened to fp32 and multiplied by their block's scale as they are loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import LOG2E, chunk_tokens, dot_precision, fp8_scales, is_fp8, next_pow2, pow2
from kvflash.kernels.triton_prefill import compiled

LN2 = tl.constexpr(0.6931471805599453)
LSE_ROWS = 64
"""(query token, head) rows scored per step against a chunk's keys: bounds the logit tile at
LSE_ROWS x chunk_tokens."""


@triton.jit
def _key_rows(
    kv_ptr, slots_ptr, stride_slot, stride_layer, stride_head, stride_tok, n_heads, C: tl.constexpr
):
    """This program's (listed chunk, layer, kv-head), the pointers to that chunk's C key rows [C, 1],
    and the offset of its key block (in elements)."""
    ci = tl.program_id(0)
    lh = tl.program_id(1)
    layer = lh // n_heads
    h = lh % n_heads
    slot = tl.load(slots_ptr + ci).to(tl.int64)
    t = tl.arange(0, C)
    block = slot * stride_slot + layer * stride_layer + h * stride_head
    return ci, layer, h, kv_ptr + block + t[:, None] * stride_tok, block


@triton.jit
def _key_scale(sc_ptr, block, FP8: tl.constexpr):
    """The fp32 scale of an fp8 key block (the scale view starts C rows into the pool), else 1."""
    if FP8:
        return tl.load(sc_ptr + block // 4)
    return 1.0


@triton.jit
def _summary_kernel(
    kv_ptr,
    sc_ptr,
    slots_ptr,
    out_ptr,
    stride_slot,
    stride_layer,
    stride_head,
    stride_tok,
    n_layers,
    n_heads,
    B: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
):
    i, layer, h, k_rows, block = _key_rows(
        kv_ptr, slots_ptr, stride_slot, stride_layer, stride_head, stride_tok, n_heads, C
    )
    d = tl.arange(0, D)
    k = tl.load(k_rows + d[None, :]).to(tl.float32) * _key_scale(sc_ptr, block, FP8)
    means = tl.sum(tl.reshape(k, (B, C // B, D)), 1) / (C // B)
    blk = tl.arange(0, B)
    rows = ((i * n_layers + layer) * n_heads + h) * B + blk
    tl.store(out_ptr + rows[:, None] * D + d[None, :], means)


def chunk_summaries(kv_pool: torch.Tensor, slots: torch.Tensor, blocks: int) -> torch.Tensor:
    """Same contract as reference.chunk_summaries."""
    n = slots.numel()
    _, n_layers, _, h_kv, _, d = kv_pool.shape
    c, s, fp8 = chunk_tokens(kv_pool), kv_pool.stride(), is_fp8(kv_pool)
    assert s[5] == 1 and slots.is_contiguous() and pow2(blocks) and c % blocks == 0
    out = torch.empty((n, n_layers, h_kv, blocks, d), dtype=torch.float32, device=kv_pool.device)
    if n:
        _summary_kernel[(n, n_layers * h_kv)](
            kv_pool, fp8_scales(kv_pool) if fp8 else None, slots, out, s[0], s[1], s[3], s[4], n_layers,
            h_kv, B=blocks, C=c, D=d, FP8=fp8,
        )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n_rows", "stride_ql", "stride_qt", "stride_ol", "stride_ot", "stride_oh"])
def _lse_kernel(
    q_ptr,
    kv_ptr,
    sc_ptr,
    slots_ptr,
    rot_ptr,
    out_ptr,
    n_rows,
    qk_scale,
    stride_ql,
    stride_qt,
    stride_qh,
    stride_ol,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_layer,
    stride_head,
    stride_tok,
    n_heads,
    G: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SHIFTED: tl.constexpr,
    PREC: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program per (chunk, layer, kv-head): the chunk's keys are loaded once and every recorded
    (query token, head of the group) row is scored against them, BLOCK_R rows a step. Rows are
    r -> token r // G, query head h * G + r % G. With SHIFTED the query is turned back by the chunk's
    rotation instead of turning every key forward (the same dot product)."""
    ci, layer, h, k_rows, block = _key_rows(
        kv_ptr, slots_ptr, stride_slot, stride_layer, stride_head, stride_tok, n_heads, C
    )
    k_scale = _key_scale(sc_ptr, block, FP8)
    if SHIFTED:
        hd = tl.arange(0, D // 2)
        ka = tl.load(k_rows + hd[None, :]).to(tl.float32) * k_scale
        kb = tl.load(k_rows + D // 2 + hd[None, :]).to(tl.float32) * k_scale
        cos = tl.load(rot_ptr + ci * D + hd)[None, :]
        sin = tl.load(rot_ptr + ci * D + D // 2 + hd)[None, :]
    else:
        d = tl.arange(0, D)
        k = tl.load(k_rows + d[None, :]).to(tl.float32) * k_scale
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        live = r < n_rows
        q_rows = q_ptr + layer * stride_ql + (r // G) * stride_qt + (h * G + r % G) * stride_qh
        if SHIFTED:
            qa = tl.load(q_rows[:, None] + hd[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            qb = tl.load(q_rows[:, None] + D // 2 + hd[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            logits = tl.dot(qa * cos + qb * sin, tl.trans(ka), input_precision=PREC)
            logits += tl.dot(qb * cos - qa * sin, tl.trans(kb), input_precision=PREC)
        else:
            qv = tl.load(q_rows[:, None] + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
            logits = tl.dot(qv, tl.trans(k), input_precision=PREC)
        logits = logits * qk_scale
        m = tl.max(logits, 1)
        lse = (m + tl.log2(tl.sum(tl.exp2(logits - m[:, None]), 1))) * LN2
        out_rows = out_ptr + layer * stride_ol + (r // G) * stride_ot + (h * G + r % G) * stride_oh + ci
        tl.store(out_rows, lse, mask=live)


def chunk_lse(
    q: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as reference.chunk_lse."""
    n_layers, t, hq, d = q.shape
    h_kv, c, fp8 = kv_pool.shape[3], chunk_tokens(kv_pool), is_fp8(kv_pool)
    s = kv_pool.stride()
    assert s[5] == 1 and q.stride(3) == 1 and slots.is_contiguous() and kv_pool.shape[1] == n_layers
    n, g = slots.numel(), hq // h_kv
    assert rot is None or (rot.dtype == torch.float32 and rot.is_contiguous() and rot.shape[0] == n)
    out = torch.empty((n_layers, t, hq, n), dtype=torch.float32, device=q.device)
    if n:
        rows = t * g
        _lse_kernel[(n, n_layers * h_kv)](
            q, kv_pool, fp8_scales(kv_pool) if fp8 else None, slots, rot, out, rows, d**-0.5 * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
            s[0], s[1], s[3], s[4], h_kv,
            G=g, C=c, D=d, BLOCK_R=_block_r(rows), SHIFTED=rot is not None,
            PREC=dot_precision(kv_pool.dtype), FP8=fp8, num_warps=4 if d <= 64 else 8,
        )  # fmt: skip
    return out


def _block_r(rows: int) -> int:
    return min(LSE_ROWS, max(16, next_pow2(rows)))


def warm_lse(kv_pool: torch.Tensor, hq: int, dtype: torch.dtype) -> None:
    """Compiles, or loads from Triton's cache, each variant of `chunk_lse` (every row tile, keys
    rotated or not) on scratch queries over slot 0, as `triton_prefill.warm_prefill` does for the
    prefill: a scout's row tile follows its question's length."""
    n_layers, d, g, dev = kv_pool.shape[1], kv_pool.shape[5], hq // kv_pool.shape[3], kv_pool.device
    slots = torch.zeros(1, dtype=torch.int32, device=dev)
    rot = torch.zeros(1, 2, d // 2, dtype=torch.float32, device=dev)
    tiles = {_block_r(t * g): t for t in range(LSE_ROWS, 0, -1)}  # the shortest t of each tile
    for t in tiles.values():
        q = torch.zeros(n_layers, t, hq, d, dtype=dtype, device=dev)
        for r in (None, rot):
            compiled(chunk_lse, q, kv_pool, slots, r)
