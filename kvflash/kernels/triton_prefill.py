"""Chunked-prefill attention: a block of one sequence's queries against its listed slots, causal.

Flash-attention style: one program per (query block, query head, split) keeps its output tile on
chip and streams K/V tiles of CPI whole chunks. The listed slots are in logical order, so the slots
wholly before the block's first query need no mask, the next ones up to its last query are masked,
and the rest (wholly in its future) are never read. A step of a few hundred queries over a long
context has too few (query block, head) programs to fill the GPU (72 for a 512-token step of
SmolLM2's 9 heads on 132 SMs), so then the unmasked slots are split between programs, each writing
a partial output and its log-sum-exp, merged by the decode kernel's combine (`prefill_splits`). With
`rot` (positions within the cache) each key chunk is scored against the queries turned back by that
chunk's rotation, one chunk per tile. An fp8 pool's tiles are widened to fp16 (V gathered into token
order from its channel-major blocks), their scales applied to the logits and the probabilities.

A mixed step's prefill pieces (the next turns of many conversations, each a few dozen queries over
its own long context) attend in one launch (`prefill_attention_batched`): the grid's third axis is
the piece instead of the split, and each program reads its piece's rows, first position and
listing from a table. One launch a layer instead of one a piece: the host, not the GPU, bounds such
a step (docs/BENCHMARKS.md: The scheduler alone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError

from kvflash.kernels._common import (
    LOG2E,
    chunk_tokens,
    dot_precision,
    f32_dot,
    fp8_scales,
    is_fp8,
    next_pow2,
    pool_strides,
    sm_count,
)
from kvflash.kernels.triton_decode import (
    COMBINE_COLS,
    COMBINE_ROWS,
    FP8_P_UP,
    _chunk_offsets,
    _combine_kernel,
    _shifted_qk,
)

BLOCK_TOKENS = 64
"""Keys per inner step: whole chunks, at least this many."""
COUNT_STEP = 256
"""Chunk positions examined per step when counting a block's visible slots."""
PROGRAMS_PER_SM = 2
"""Programs per SM a step's (query block, head, split) grid should reach: splits are added until it
does."""
MIN_SPLIT_BLOCKS = 4
"""A split reads at least this many key tiles, so its partial output stays a small share of its work."""
MAX_SPLITS = 16
"""Bounds the partial buffers of short steps (a 64-token step of 4 heads would want 66 splits)."""
PIECE_FIELDS = tl.constexpr(5)
"""A batched launch's table row per piece (int32): first row of q, rows, first position, first
listed slot, slots listed."""
TILE_ELEMS_DEEP = 64 * 128
"""Query tiles up to this many elements get 3 pipeline stages in the unmasked loop, larger ones 2
(shared memory). The masked (diagonal) loop runs unpipelined: it is one or two steps long, and
Triton 3.6 gives wrong results on the H200 when it is pipelined."""


@triton.jit
def _count_le(chunk_index_ptr, n, limit, C: tl.constexpr, END: tl.constexpr, STEP: tl.constexpr):
    """How many listed chunks start at or before `limit` (END=0) or end at or before it (END=1)."""
    cnt = tl.full((), 0, tl.int32)
    for i0 in range(0, n, STEP):
        i = i0 + tl.arange(0, STEP)
        ci = tl.load(chunk_index_ptr + i, mask=i < n, other=0)
        cnt += tl.sum(((ci * C + END * (C - 1) <= limit) & (i < n)).to(tl.int32), 0)
    return cnt


@triton.jit
def _load_e4m3_as_f16(row_ptrs, mask, N: tl.constexpr):
    """A [R, N] tile of e4m3 rows (starting at `row_ptrs`, 2-byte aligned) widened to fp16 where it
    is loaded, a pair of values at a time (exact: e4m3 is a subset of fp16), masked by row. Left to
    the compiler, an e4m3 tile that a dot takes transposed would be widened inside the dot's operand
    layout, read one byte at a time; widened here, it reaches the dot as an fp16 tile does. It
    leaves through an opaque move: Triton sizes a dot's operand registers by the narrowest load
    behind them, and seeing the pairs' join it would pick 8-bit operands, reshuffled for every
    fp16 instruction."""
    pairs = row_ptrs.to(tl.pointer_type(tl.int16))[:, None] + tl.arange(0, N // 2)[None, :]
    lo, hi = tl.inline_asm_elementwise(
        "{ .reg .b32 x; cvt.rn.f16x2.e4m3x2 x, $2; mov.b32 {$0, $1}, x; }",
        "=h,=h,h",
        [tl.load(pairs, mask=mask[:, None], other=0)],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )
    tile = tl.reshape(tl.join(lo, hi), (lo.shape[0], N))  # value 2i + 1 is the high byte of pair i
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [tile], dtype=tl.float16, is_pure=False, pack=2
    )


@triton.jit
def _attend_blocks(
    acc,
    m_i,
    l_i,
    q,
    qa,
    qb,
    rot_ptr,
    q_pos,
    last_pos,
    k_base,
    sc_base,
    slots_ptr,
    chunk_index_ptr,
    blk_lo,
    blk_hi,
    n_vis,
    qk_scale,
    stride_slot,
    stride_kv,
    stride_tok,
    C: tl.constexpr,
    CPI: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREC: tl.constexpr,
    STAGES: tl.constexpr,
    SHIFTED: tl.constexpr,
    FP8: tl.constexpr,
):
    """Online-softmax update over blocks [blk_lo, blk_hi); MASKED applies the causal and list-end masks."""
    t = tl.arange(0, CPI * C)
    d = tl.arange(0, D)
    t_row = (t % C) * stride_tok
    for blk in tl.range(blk_lo, blk_hi, num_stages=STAGES):
        ci = blk * CPI + t // C
        slot = tl.load(slots_ptr + ci, mask=ci < n_vis, other=0).to(tl.int64)
        rows = slot * stride_slot + t_row
        if MASKED:
            key_pos = tl.load(chunk_index_ptr + ci, mask=ci < n_vis, other=0) * C + t % C
            live = (ci < n_vis) & (key_pos <= last_pos)
        else:
            live = t < CPI * C
        if SHIFTED:  # one chunk a block (CPI == 1)
            qk = _shifted_qk(
                qa, qb, rot_ptr + blk * D, k_base + rows[:, None], live[:, None], D, F32_DOT, PREC, FP8
            )
        elif MASKED:
            k = tl.load(k_base + rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
        else:
            k = tl.load(k_base + rows[:, None] + d[None, :])
        if FP8 and CPI == 1 and not F32_DOT:  # one block: V^T's rows widened as pairs, then turned
            v_block = tl.load(slots_ptr + blk, mask=blk < n_vis, other=0).to(tl.int64) * stride_slot
            v_rows = k_base + stride_kv + v_block + d * C
            v = tl.where(live[:, None], tl.trans(_load_e4m3_as_f16(v_rows, d < D, C)), 0.0)
        elif FP8:  # V^T [D, T] from channel-major blocks, each chunk's row a run the compiler can see
            v_cols = k_base + stride_kv + _chunk_offsets(slots_ptr, blk, n_vis, t, stride_slot, C, CPI, True)
            v = tl.load(v_cols[None, :] + t[None, :] % C + d[:, None] * C, mask=live[None, :], other=0.0)
            v = tl.trans(v)
        elif MASKED or SHIFTED:
            v = tl.load(k_base + stride_kv + rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
        else:
            v = tl.load(k_base + stride_kv + rows[:, None] + d[None, :])
        if not SHIFTED:
            if F32_DOT:
                k = k.to(tl.float32)
            elif FP8:
                k = k.to(tl.float16)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if F32_DOT:
            v = v.to(tl.float32)
        elif FP8 and CPI > 1:
            v = v.to(tl.float16)
        if FP8:  # each key's chunk's scales
            sc_rows = sc_base + slot * stride_slot // 4
            qk = qk * tl.load(sc_rows, mask=live, other=0.0)[None, :]
        qk = qk * qk_scale
        if MASKED:
            qk = tl.where(live[None, :] & (key_pos[None, :] <= q_pos[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * (tl.load(sc_rows + stride_kv // 4, mask=live, other=0.0) * FP8_P_UP)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["n", "n_splits", "q_start", "T"])
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    slots_ptr,
    chunk_index_ptr,
    rot_ptr,
    sc_ptr,
    o_ptr,
    o_part_ptr,
    lse_ptr,
    pieces_ptr,
    n,
    n_splits,
    q_start,
    T,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    layer_off,
    stride_slot,
    stride_kv,
    stride_head,
    stride_tok,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    C: tl.constexpr,
    CPI: tl.constexpr,
    D: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREC: tl.constexpr,
    COUNT: tl.constexpr,
    FULL_STAGES: tl.constexpr,
    SHIFTED: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    BATCHED: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    if BATCHED:  # the third axis is the piece: its rows, first position and listing from its row
        piece = pieces_ptr + s * PIECE_FIELDS
        q_lo = tl.load(piece)
        T = tl.load(piece + 1)
        q_start = tl.load(piece + 2)
        list_lo = tl.load(piece + 3)
        n = tl.load(piece + 4)
        s = 0
        q_ptr += q_lo.to(tl.int64) * stride_qt
        o_ptr += q_lo.to(tl.int64) * stride_ot
        slots_ptr += list_lo
        chunk_index_ptr += list_lo
        beyond = mb * BLOCK_M >= T  # a block past a short piece's rows reads and writes nothing
        n = tl.where(beyond, 0, n)
        T = tl.where(beyond, 0, T)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q_pos = q_start + r
    q = tl.load(q_ptr + r[:, None] * stride_qt + h * stride_qh + d[None, :], mask=(r < T)[:, None], other=0.0)
    if FP8:
        q = q.to(tl.float16)
    else:
        q = q.to(kv_ptr.dtype.element_ty)
    if F32_DOT:
        q = q.to(tl.float32)
    qa = q
    qb = q
    if SHIFTED:
        hd = tl.arange(0, D // 2)
        q_rows = q_ptr + r[:, None] * stride_qt + h * stride_qh + hd[None, :]
        qa = tl.load(q_rows, mask=(r < T)[:, None], other=0.0).to(tl.float32)
        qb = tl.load(q_rows + D // 2, mask=(r < T)[:, None], other=0.0).to(tl.float32)

    first_pos = q_start + mb * BLOCK_M
    last_pos = q_start + tl.minimum(mb * BLOCK_M + BLOCK_M, T) - 1
    n_full = _count_le(chunk_index_ptr, n, first_pos, C, 1, COUNT)
    n_vis = _count_le(chunk_index_ptr, n, last_pos, C, 0, COUNT)
    full_blocks = n_full // CPI

    k_base = kv_ptr + layer_off + (h // G) * stride_head
    sc_base = sc_ptr
    if FP8:
        sc_base = sc_ptr + (layer_off + (h // G) * stride_head) // 4  # the scale view starts C rows in
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    per_split = tl.cdiv(full_blocks, n_splits)
    blk_lo = tl.minimum(s * per_split, full_blocks)
    blk_hi = tl.minimum(blk_lo + per_split, full_blocks)
    acc, m_i, l_i = _attend_blocks(
        acc, m_i, l_i, q, qa, qb, rot_ptr, q_pos, last_pos, k_base, sc_base, slots_ptr, chunk_index_ptr,
        blk_lo, blk_hi, n_vis, qk_scale, stride_slot, stride_kv, stride_tok, C, CPI, D, False, F32_DOT,
        PREC, FULL_STAGES, SHIFTED, FP8,
    )  # fmt: skip
    if s == n_splits - 1:  # the last split also reads the masked slots, up to the block's last query
        acc, m_i, l_i = _attend_blocks(
            acc, m_i, l_i, q, qa, qb, rot_ptr, q_pos, last_pos, k_base, sc_base, slots_ptr,
            chunk_index_ptr, full_blocks, tl.cdiv(n_vis, CPI), n_vis, qk_scale, stride_slot, stride_kv,
            stride_tok, C, CPI, D, True, F32_DOT, PREC, 1, SHIFTED, FP8,
        )  # fmt: skip
    if FP8:
        acc = acc * (1.0 / FP8_P_UP)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if SPLIT:
        part = (r * tl.num_programs(1) + h) * n_splits + s
        tl.store(o_part_ptr + part[:, None] * D + d[None, :], out, mask=(r < T)[:, None])
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=r < T)
    else:
        tl.store(
            o_ptr + r[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=(r < T)[:, None],
        )


BLOCK_MS = (16, 32, 64, 128)
"""Every query tile `_block_m` picks."""


def warm_prefill(kv_pool: torch.Tensor, hq: int, dtype: torch.dtype) -> None:
    """Compiles, or loads from Triton's cache, every variant of the prefill kernels a step on this
    pool can launch (each query tile, keys rotated or not, split or not, batched pieces, the combine
    for each power of two of splits), on scratch queries over slot 0 (read only). A variant first
    met inside a turn would compile there: a lazily restored turn's short question scouts with
    rotated keys and splits, which no earlier step of the process ran."""
    d, c, dev = kv_pool.shape[5], chunk_tokens(kv_pool), kv_pool.device
    n = MAX_SPLITS * MIN_SPLIT_BLOCKS * max(1, BLOCK_TOKENS // c)  # key tiles for every split
    slots = torch.zeros(n, dtype=torch.int32, device=dev)
    index = torch.arange(n, dtype=torch.int32, device=dev)
    rot = torch.zeros(n, 2, d // 2, dtype=torch.float32, device=dev)
    for block_m in BLOCK_MS:
        q = torch.zeros(block_m, hq, d, dtype=dtype, device=dev)
        for r in (None, rot):
            for splits in (1, 2):
                compiled(prefill_attention, q, kv_pool, 0, slots, index, n * c, 1.0, r, splits, block_m)
        pieces = torch.tensor([[i * block_m, block_m, n * c, 0, n] for i in range(2)], dtype=torch.int32)
        two = (q.repeat(2, 1, 1), kv_pool, 0, pieces.to(dev), slots, index, block_m, 1.0, block_m)
        compiled(prefill_attention_batched, *two)  # two pieces over the same listing
    q = torch.zeros(BLOCK_MS[0], hq, d, dtype=dtype, device=dev)
    for k in range(2, (MAX_SPLITS - 1).bit_length() + 1):  # the combine's rows: 4, 8, ... splits
        compiled(prefill_attention, q, kv_pool, 0, slots, index, n * c, 1.0, None, 2**k, BLOCK_MS[0])


def compiled(launch, *args) -> None:
    """Runs a warm-up launch; a variant these shapes cannot compile (a tile too small for a dot of
    a tiny model's head) is left out: a step that launched it would fail the same way."""
    try:
        launch(*args)
    except CompilationError:
        pass


def _block_m(t: int, hq: int, device: torch.device) -> int:
    """128-row query tiles, or 64 when 128 would leave SMs idle (short query blocks)."""
    if t <= 64 or triton.cdiv(t, 128) * hq < 2 * sm_count(device):
        return 64 if t > 32 else 32 if t > 16 else 16
    return 128


def prefill_splits(programs: int, blocks: int, device: torch.device) -> int:
    """Splits of the unmasked key tiles. A grid of `programs` (query blocks x heads) with one per SM
    or more keeps one (splitting it is slower); a smaller one is split until it has PROGRAMS_PER_SM a
    SM, no split shorter than MIN_SPLIT_BLOCKS of the `blocks` tiles listed (docs/BENCHMARKS.md:
    Cold prefill)."""
    sms = sm_count(device)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, programs), blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


def prefill_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    q_start: int,
    sm_scale: float,
    rot: torch.Tensor | None = None,
    n_splits: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.prefill_attention; chunk_index must be ascending (logical order).
    With `rot` [n, 2, D/2] fp32 the kernel walks one chunk a block, turning the queries by each
    chunk's rotation. `n_splits` overrides `prefill_splits`, `block_m` the query tile (`_block_m`)."""
    t, hq, d = q.shape
    h_kv, c = kv_pool.shape[3], chunk_tokens(kv_pool)
    assert q.stride(2) == 1 and slots.is_contiguous() and chunk_index.is_contiguous()
    cpi = 1 if rot is not None else max(1, BLOCK_TOKENS // c)
    if rot is not None:
        assert rot.dtype == torch.float32 and rot.is_contiguous() and rot.shape == (slots.numel(), 2, d // 2)
    block_m = block_m or _block_m(t, hq, q.device)
    q_blocks = triton.cdiv(t, block_m)
    splits = n_splits or prefill_splits(q_blocks * hq, slots.numel() // cpi, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    o_part = lse = None
    if splits > 1:
        o_part = torch.empty((t, hq, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    layer_off, s_slot, s_kv, s_head, s_tok = pool_strides(kv_pool, layer)
    _prefill_kernel[(q_blocks, hq, splits)](
        q,
        kv_pool,
        slots,
        chunk_index,
        rot,
        fp8_scales(kv_pool) if is_fp8(kv_pool) else None,
        out,
        o_part,
        lse,
        None,
        slots.numel(),
        splits,
        q_start,
        t,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        layer_off,
        s_slot,
        s_kv,
        s_head,
        s_tok,
        G=hq // h_kv,
        BLOCK_M=block_m,
        C=c,
        CPI=cpi,
        D=d,
        F32_DOT=f32_dot(q),
        PREC=dot_precision(kv_pool.dtype),
        COUNT=COUNT_STEP,
        FULL_STAGES=3 if block_m * d <= TILE_ELEMS_DEEP else 2,
        SHIFTED=rot is not None,
        SPLIT=splits > 1,
        FP8=is_fp8(kv_pool),
        BATCHED=False,
        num_warps=8 if block_m == 128 else 4,
    )
    if splits > 1:
        cols = min(d, COMBINE_COLS)
        _combine_kernel[(t, hq, d // cols)](
            o_part, lse, out, splits, out.stride(0), out.stride(1),
            D=d, COLS=cols, ROWS=min(COMBINE_ROWS, next_pow2(splits)), PDL=False, num_warps=4,
        )  # fmt: skip
    return out


def prefill_attention_batched(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    pieces: torch.Tensor,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    max_t: int,
    sm_scale: float,
    block_m: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.prefill_attention_batched, in one launch: the pieces' keys are not
    rotated and none is split (there are programs enough across the pieces). `block_m` overrides
    the query tile (`_block_m`)."""
    t, hq, d = q.shape
    h_kv, c = kv_pool.shape[3], chunk_tokens(kv_pool)
    n_pieces = pieces.shape[0]
    assert q.stride(2) == 1 and pieces.is_contiguous() and pieces.shape[1] == PIECE_FIELDS
    assert slots.is_contiguous() and chunk_index.is_contiguous()
    block_m = block_m or _block_m(max_t, hq * n_pieces, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    layer_off, s_slot, s_kv, s_head, s_tok = pool_strides(kv_pool, layer)
    _prefill_kernel[(triton.cdiv(max_t, block_m), hq, n_pieces)](
        q, kv_pool, slots, chunk_index, None, fp8_scales(kv_pool) if is_fp8(kv_pool) else None,
        out, None, None, pieces, 0, 1, 0, 0, sm_scale * LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), layer_off, s_slot, s_kv, s_head, s_tok,
        G=hq // h_kv, BLOCK_M=block_m, C=c, CPI=max(1, BLOCK_TOKENS // c), D=d, F32_DOT=f32_dot(q),
        PREC=dot_precision(kv_pool.dtype), COUNT=COUNT_STEP,
        FULL_STAGES=3 if block_m * d <= TILE_ELEMS_DEEP else 2, SHIFTED=False, SPLIT=False,
        FP8=is_fp8(kv_pool), BATCHED=True, num_warps=8 if block_m == 128 else 4,
    )  # fmt: skip
    return out
