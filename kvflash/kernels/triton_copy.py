"""Writes of a step's K/V into the pool.

`write_tokens` scatters a step's new K/V rows into their slots in one launch (the torch twin needs
two advanced-indexing writes); into an fp8 pool it quantises them, the program of a chunk's first
token setting the chunk's scales from the run of tokens it leads (reference.write_tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import (
    FP8_HEADROOM,
    FP8_MAX,
    chunk_tokens,
    fp8_scales,
    is_fp8,
    next_pow2,
    pool_strides,
)

RUN_TOKENS = 16
"""Tokens of a run an fp8 write's leading program loads per step (a [tokens, heads, D] tile)."""


@triton.jit
def _write_kernel(
    kv_ptr,
    slot_ptr,
    offset_ptr,
    k_ptr,
    v_ptr,
    n_heads,
    layer_off,
    stride_slot,
    stride_kv,
    stride_head,
    stride_tok,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (hh < n_heads)[:, None]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    off = tl.load(offset_ptr + t).to(tl.int64)
    dst = kv_ptr + layer_off + slot * stride_slot + off * stride_tok + hh[:, None] * stride_head + d[None, :]
    ty = kv_ptr.dtype.element_ty
    k = tl.load(k_ptr + t * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(dst, k.to(tl.float32).to(ty), mask=mask)
    tl.store(dst + stride_kv, v.to(tl.float32).to(ty), mask=mask)


@triton.jit
def to_e4m3(x, scale):
    """x / scale (fp32, correctly rounded), clamped to ±448 and rounded to the nearest e4m3fn, ties
    to even: torch's conversion, done in fp32 bit arithmetic so that the result is exact wherever
    the kernel runs (the CPU interpreter's own conversion truncates)."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    ay = tl.abs(y)
    bits = ay.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, in steps of 2^-9: adding 2^23 rounds |y| * 2^9 to an integer
    sub = ((ay * 512.0 + 8388608.0).to(tl.int32, bitcast=True) & 0x7FFFFF).to(tl.float32) * 0.001953125
    r = tl.where(ay < 0.015625, sub, normal)
    # the sign as a bit, not a negation: the compiled kernel negates as 0 - r, which turns -0 into +0
    sign = y.to(tl.int32, bitcast=True) & -0x80000000
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return r.to(tl.float8e4nv)


@triton.jit(do_not_specialize=["T"])
def _write_fp8_kernel(
    kv_ptr,
    sc_ptr,
    slot_ptr,
    offset_ptr,
    k_ptr,
    v_ptr,
    T,
    n_heads,
    layer_off,
    stride_slot,
    stride_kv,
    stride_head,
    stride_tok,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TB: tl.constexpr,
    MUL_WHOLE: tl.constexpr,
    MUL_PART: tl.constexpr,
):
    """Program t stores token t, unless a run of this write leads its chunk: then the run's leader
    (the token at offset 0) sets the chunk's scales and stores the whole run, and the others return.
    V is stored channel-major (`_common.fp8_v_tokens`): token t of channel d at d * C + t in its block."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    off = tl.load(offset_ptr + t)
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    hm = hh < n_heads
    block = layer_off + slot * stride_slot + hh * stride_head  # [BLOCK_H] elements: K's block of each head
    sc_k = sc_ptr + block // 4  # the scale view starts C rows into the pool; strides are multiples of 4
    sc_v = sc_ptr + (block + stride_kv) // 4
    lead = t - off  # where this chunk's first token would be in the write
    lead_slot = tl.load(slot_ptr + lead, mask=lead >= 0, other=-1).to(tl.int64)
    lead_off = tl.load(offset_ptr + lead, mask=lead >= 0, other=-1)
    if off == 0:
        j = tl.arange(0, C)
        nxt = t + j
        inside = nxt < T
        same = inside & (tl.load(slot_ptr + nxt, mask=inside, other=-1).to(tl.int64) == slot)
        same = same & (tl.load(offset_ptr + nxt, mask=inside, other=-1) == j)
        run = tl.min(tl.where(same, C, j), 0)  # the first j not in the run (j = 0 always is)
        amax_k = tl.zeros([BLOCK_H], tl.float32)
        amax_v = tl.zeros([BLOCK_H], tl.float32)
        for j0 in range(0, C, TB):
            jj = j0 + tl.arange(0, TB)
            m = (jj < run)[:, None, None] & hm[None, :, None]
            rows = (t + jj)[:, None, None]
            k = tl.load(
                k_ptr + rows * stride_kt + hh[None, :, None] * stride_kh + d[None, None, :], mask=m, other=0.0
            )
            v = tl.load(
                v_ptr + rows * stride_vt + hh[None, :, None] * stride_vh + d[None, None, :], mask=m, other=0.0
            )
            amax_k = tl.maximum(amax_k, tl.max(tl.max(tl.abs(k.to(tl.float32)), 2), 0))
            amax_v = tl.maximum(amax_v, tl.max(tl.max(tl.abs(v.to(tl.float32)), 2), 0))
        mul = tl.where(run == C, MUL_WHOLE, MUL_PART)
        s_k = tl.where(amax_k > 0, amax_k * mul, 1.0)
        s_v = tl.where(amax_v > 0, amax_v * mul, 1.0)
        tl.store(sc_k, s_k, mask=hm)
        tl.store(sc_v, s_v, mask=hm)
        for j0 in range(0, C, TB):
            jj = j0 + tl.arange(0, TB)
            m = (jj < run)[:, None, None] & hm[None, :, None]
            rows = (t + jj)[:, None, None]
            k = tl.load(
                k_ptr + rows * stride_kt + hh[None, :, None] * stride_kh + d[None, None, :], mask=m, other=0.0
            )
            v = tl.load(
                v_ptr + rows * stride_vt + hh[None, :, None] * stride_vh + d[None, None, :], mask=m, other=0.0
            )
            dst = kv_ptr + block[None, :, None] + jj[:, None, None] * stride_tok + d[None, None, :]
            dst_v = kv_ptr + block[None, :, None] + stride_kv + d[None, None, :] * C + jj[:, None, None]
            tl.store(dst, to_e4m3(k.to(tl.float32), s_k[None, :, None]), mask=m)
            tl.store(dst_v, to_e4m3(v.to(tl.float32), s_v[None, :, None]), mask=m)
    elif (lead_slot != slot) | (lead_off != 0):  # no run of this write leads the chunk
        s_k = tl.load(sc_k, mask=hm, other=1.0)
        s_v = tl.load(sc_v, mask=hm, other=1.0)
        k = tl.load(k_ptr + t * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=hm[:, None], other=0.0)
        v = tl.load(v_ptr + t * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=hm[:, None], other=0.0)
        dst = kv_ptr + block[:, None] + off * stride_tok + d[None, :]
        dst_v = kv_ptr + block[:, None] + stride_kv + d[None, :] * C + off
        tl.store(dst, to_e4m3(k.to(tl.float32), s_k[:, None]), mask=hm[:, None])
        tl.store(dst_v, to_e4m3(v.to(tl.float32), s_v[:, None]), mask=hm[:, None])


def write_tokens(
    kv_pool: torch.Tensor,
    layer: int,
    slot: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Same contract as reference.write_tokens."""
    t, h_kv, d = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and slot.is_contiguous() and offset.is_contiguous()
    if not t:
        return
    layer_off, s_slot, s_kv, s_head, s_tok = pool_strides(kv_pool, layer)
    if is_fp8(kv_pool):
        c = chunk_tokens(kv_pool)
        _write_fp8_kernel[(t,)](
            kv_pool, fp8_scales(kv_pool), slot, offset, k, v, t, h_kv,
            layer_off, s_slot, s_kv, s_head, s_tok, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            C=c, D=d, BLOCK_H=next_pow2(h_kv), TB=min(c, RUN_TOKENS),
            MUL_WHOLE=1.0 / FP8_MAX, MUL_PART=FP8_HEADROOM / FP8_MAX,
        )  # fmt: skip
        return
    _write_kernel[(t,)](
        kv_pool,
        slot,
        offset,
        k,
        v,
        h_kv,
        layer_off,
        s_slot,
        s_kv,
        s_head,
        s_tok,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        D=d,
        BLOCK_H=next_pow2(h_kv),
    )
