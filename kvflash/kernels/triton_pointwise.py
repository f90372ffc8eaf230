"""A decoder layer's small ops, one launch each: RMSNorm (with the residual add before it), RoPE on
q and k together, and SiLU(gate) * up.

A decode step moves one token through each layer, so every op is tiny and costs what its launch
costs: torch spends 6 kernels on an RMSNorm, 10 on RoPE and 2 on the gated activation, about two
thirds of a SmolLM2 step's kernels. Each kernel rounds where its torch twin (`reference`) rounds,
so results differ from the twin's by fp32 summation order at most.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import next_pow2

SILU_BLOCK = 1024
"""Output columns per program of `silu_mul`."""


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    ty = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(ty)  # the residual stream is kept in the model's dtype, as torch keeps it
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * inv).to(ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.rms_norm."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = out if residual is None else torch.empty_like(out)
    r = x if residual is None else residual
    _rms_norm_kernel[(t,)](
        x, r, weight, out, res_out, n, eps,
        x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
        HAS_RES=residual is not None, BLOCK=next_pow2(n), num_warps=4 if n <= 2048 else 8,
    )  # fmt: skip
    return out, (x if residual is None else res_out)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, n_q_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < n_q_heads:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - n_q_heads) * stride_kh
    d = tl.arange(0, HALF)
    ty = q_ptr.dtype.element_ty
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + d)
    sin = tl.load(sin_ptr + t * stride_ct + d)
    tl.store(base + d, (x1 * cos - x2 * sin).to(ty))
    tl.store(base + HALF + d, (x2 * cos + x1 * sin).to(ty))


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.rotary_qk; turns q and k in place (views of one qkv row are fine)."""
    t, hq, d = q.shape
    assert q.stride(2) == 1 and k.stride(2) == 1 and q.dtype == k.dtype
    assert cos.dtype == torch.float32 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    _rotary_kernel[(t, hq + k.shape[1])](
        q, k, cos, sin, hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=d // 2, num_warps=1,
    )  # fmt: skip
    return q, k


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    ty = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.silu_mul."""
    t, n2 = gate_up.shape
    assert gate_up.stride(1) == 1
    n = n2 // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, next_pow2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out
