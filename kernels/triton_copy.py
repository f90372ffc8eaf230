"""Moves of K/V between step tensors, the pool and staging buffers.

`write_tokens` scatters a step's new K/V rows into their slots in one launch (the torch twin needs
two advanced-indexing writes). `gather_chunks` / `scatter_chunks` pack scattered slots into one
contiguous staging tensor and back, so a tier move of many chunks is one host copy.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import next_pow2, pool_strides

COPY_BLOCK = 4096
"""Elements per program in the chunk copies."""


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


@triton.jit
def _chunk_copy_kernel(src_ptr, dst_ptr, slots_ptr, chunk_elems, TO_POOL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = e < chunk_elems
    slot = tl.load(slots_ptr + i).to(tl.int64)
    staged = i.to(tl.int64) * chunk_elems + e
    pooled = slot * chunk_elems + e
    if TO_POOL:
        tl.store(dst_ptr + pooled, tl.load(src_ptr + staged, mask=mask), mask=mask)
    else:
        tl.store(dst_ptr + staged, tl.load(src_ptr + pooled, mask=mask), mask=mask)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, to_pool: bool) -> None:
    n = slots.numel()
    elems = math.prod(src.shape[1:])
    assert src.is_contiguous() and dst.is_contiguous() and slots.is_contiguous()
    if n:
        _chunk_copy_kernel[(n, triton.cdiv(elems, COPY_BLOCK))](
            src, dst, slots, elems, TO_POOL=to_pool, BLOCK=COPY_BLOCK
        )


def gather_chunks(kv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.gather_chunks; the pool must be contiguous."""
    staging = torch.empty((slots.numel(), *kv_pool.shape[1:]), dtype=kv_pool.dtype, device=kv_pool.device)
    _launch_copy(kv_pool, staging, slots, to_pool=False)
    return staging


def scatter_chunks(staging: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """Same contract as reference.scatter_chunks; pool and staging must be contiguous."""
    _launch_copy(staging, kv_pool, slots, to_pool=True)
