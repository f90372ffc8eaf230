"""Chunk summaries (at seal time) and chunk scores against queries, for the query-aware policy.

A summary is the L2-normalised mean key of a chunk per layer and kv-head; a chunk's score is the best
cosine between any recent query head and its kv-head's summary. Both are tiny next to attention; the
kernels exist so that scoring a long history is one launch instead of a chain of torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import next_pow2

EPS = tl.constexpr(1e-12)
"""Same floor on the norm as torch.nn.functional.normalize."""
SCORE_CHUNKS = 32
"""Chunks scored per program."""


@triton.jit
def _summary_kernel(
    kv_ptr,
    slots_ptr,
    out_ptr,
    stride_slot,
    stride_layer,
    stride_head,
    stride_tok,
    n_layers,
    n_heads,
    C: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    lh = tl.program_id(1)
    layer = lh // n_heads
    h = lh % n_heads
    slot = tl.load(slots_ptr + i).to(tl.int64)
    t = tl.arange(0, C)
    d = tl.arange(0, D)
    base = kv_ptr + slot * stride_slot + layer * stride_layer + h * stride_head
    k = tl.load(base + t[:, None] * stride_tok + d[None, :]).to(tl.float32)
    mean = tl.sum(k, 0) / C
    norm = tl.sqrt(tl.sum(mean * mean, 0))
    out = mean / tl.maximum(norm, EPS)
    tl.store(out_ptr + ((i * n_layers + layer) * n_heads + h) * D + d, out)


def chunk_summaries(kv_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.chunk_summaries."""
    n = slots.numel()
    _, n_layers, _, h_kv, c, d = kv_pool.shape
    s = kv_pool.stride()
    assert s[5] == 1 and slots.is_contiguous()
    out = torch.empty((n, n_layers, h_kv, d), dtype=torch.float32, device=kv_pool.device)
    if n:
        _summary_kernel[(n, n_layers * h_kv)](
            kv_pool, slots, out, s[0], s[1], s[3], s[4], n_layers, h_kv, C=c, D=d
        )
    return out


@triton.jit
def _score_kernel(
    q_ptr,
    summ_ptr,
    out_ptr,
    N,
    n_rows,
    n_heads,
    stride_qt,
    stride_qh,
    stride_sn,
    stride_sh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Rows are (query token, head in group) pairs of one kv-head: r -> token r // G, head h * G + r % G."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for h in range(0, n_heads):
        s = tl.load(
            summ_ptr + c[:, None] * stride_sn + h * stride_sh + d[None, :], mask=(c < N)[:, None], other=0.0
        )
        s = s.to(tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            rows = (r // G) * stride_qt + (h * G + r % G) * stride_qh
            q = tl.load(q_ptr + rows[:, None] + d[None, :], mask=(r < n_rows)[:, None], other=0.0)
            q = q.to(tl.float32)
            q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 1)), EPS)[:, None]
            cos = tl.dot(s, tl.trans(q), input_precision="ieee")
            cos = tl.where((r < n_rows)[None, :], cos, float("-inf"))
            best = tl.maximum(best, tl.max(cos, 1))
    tl.store(out_ptr + c, best, mask=c < N)


def chunk_scores(q: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Same contract as reference.chunk_scores."""
    t, hq, d = q.shape
    n, h_kv = summaries.shape[0], summaries.shape[1]
    assert q.stride(2) == 1 and summaries.stride(2) == 1
    g = hq // h_kv
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    if n:
        _score_kernel[(triton.cdiv(n, SCORE_CHUNKS),)](
            q,
            summaries,
            out,
            n,
            t * g,
            h_kv,
            q.stride(0),
            q.stride(1),
            summaries.stride(0),
            summaries.stride(1),
            G=g,
            D=d,
            BLOCK_N=SCORE_CHUNKS,
            BLOCK_R=min(64, max(16, next_pow2(t * g))),
        )
    return out
