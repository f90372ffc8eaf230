"""Paged decode attention (flash-decoding) over the chunk pool.

Decode reads every resident K/V byte once per token, so it is bound by memory bandwidth. One program
owns (sequence, kv-head, split): it loads each K/V tile once and serves the whole query group from it
as one [G, D] tile (GQA), walking its share of the listed slots CPI chunks at a time. The split count
is chosen from the batch and the table width so that one wave (head_dim 128 at small batches, each
program streaming a long run through a deep pipeline) or a few waves of programs fill the device. The
splits' partial outputs are merged by their log-sum-exp, either in the same launch by the program of
each (sequence, kv-head) that finishes last (`fused`), or by a second small kernel; a single split
writes the output itself. bench/decode_tune.py times both merges side by side. With `rot`
(positions within the cache) each chunk is scored against the query turned back by that chunk's
rotation, one chunk per tile.

An fp8 pool's blocks are walked transposed (`_attend_fp8_block`): keys are the dots' M, the query
group their N, so that the K tile [T, D] and the V tile, stored channel-major within its block (V^T
[D, T]), are both contiguous along the dots' inner dimension: Hopper's e4m3 tensor-core dots (wgmma,
one warpgroup of four warps) take them from shared memory as cp.async copied them in. The query and
the weights meet them as two e4m3 terms each (a value and its remainder), about bf16's precision,
the two side by side in one operand so that a dot reads its tile once; the scales of a block of one
chunk join the exponent's multiply-add (K) and the accumulator's update (V). Widened to fp16
instead, each e4m3 byte crossed shared memory four times (copied in, read as a pair, written as
fp16, read by the dot): shared memory, not HBM, bound it. Only a sequence's last block can hold
unlisted chunks or unwritten tokens, so the blocks before it run without masks. An fp8 program of
head_dim 64 serves several kv-heads at once (`decode_heads`): their K and V^T tiles stacked along
the dots' inner dimension (two stacks where their count is not a power of two: 3 = 2 + 1), the
queries block-diagonal, so one softmax over a [T, 16] tile serves them all.

One module of some 900 lines: the split kernel, the two ways of merging its splits and the launch
rule that picks the split count and tile are tuned together (bench/decode_tune.py times them as one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvflash.kernels._common import (
    FP8_MAX,
    LOG2E,
    chunk_tokens,
    dot_precision,
    f32_dot,
    fp8_scales,
    is_fp8,
    next_pow2,
    pool_strides,
    pow2,
    prev_pow2,
    sm_count,
)
from kvflash.kernels.triton_copy import to_e4m3

BLOCK_TOKENS = 64
"""Tokens per loop iteration: whole chunks, at least this many, so short chunks still fill a tile."""
MIN_BLOCKS_PER_SPLIT = 4
"""A split reads at least this many blocks, so its partial output stays a small share of its reads."""
TILE_BYTES_PER_SM = 64 * 1024
"""K/V tile bytes each SM should have in flight to hide memory latency: sets how many programs one SM
runs at once (about two of head_dim 128 in bf16, four of head_dim 64)."""
WAVES = 4
"""Programs per resident slot: several waves keep the last, partial one a small share of the time."""
MAX_SPLITS = 256
"""Bounds the partial buffers; past a few hundred splits the device is full at any length."""
COMBINE_ROWS = 256
"""Splits merged per step of the combine kernel: every split in one step, up to MAX_SPLITS."""
COMBINE_COLS = 32
"""head_dim columns per combine program: more programs, each a single round trip to memory."""
MERGE_ELEMS = 8192
"""fp32 partial elements the merging program loads per step ([G, splits, D]): 64 registers a thread at
4 warps, so that a step keeps many loads in flight without spilling."""
COUNTERS = 4096
"""Arrival counters allocated at once per device, one per (sequence, kv-head): far above any decode
batch (64 x 8 kv-heads is 512), so the buffer exists before a CUDA graph is captured and never grows
during capture, where a new allocation would belong to the graph's private pool."""
_counters: dict[torch.device, torch.Tensor] = {}
MAX_GROUP_ROWS = 16
"""The query rows of a program's dots at the least (Triton's least N), whatever its group: fp8
programs stack kv-heads until their queries fill it (`decode_heads`). An unrotated fp8 program's
dots take its queries' two e4m3 terms side by side, so half as many queries fill them."""
MAX_STACKED_ROWS = 256
"""Rows of stacked kv-heads one fp8 program's tiles hold at most (`decode_heads`): 64-token tiles of
256 x 64 bytes (K and V^T) a stage."""
STACK_FROM_BATCH = 32
"""Sequences from which an fp8 program of head_dim 128 serves two kv-heads (`decode_heads`)."""

E4M3_MAX = tl.constexpr(FP8_MAX)
MAX_PAIRED_ACC = tl.constexpr(4096)
"""fp32 elements of an fp8 program's output tile acc^T [HD, 2G] (32 registers a thread at four warps)
up to which the weights' two e4m3 terms share one dot (`_side_by_side`); above it (SmolLM2's three
stacked kv-heads: 192 x 32) the doubled tile costs more registers than the second read of V^T saves
(under the launch's register cap its loop took 455 instructions a tile against 431 with a dot a
term), and each term takes a dot of its own."""
FP8_P_UP = tl.constexpr(256.0)
"""What an fp8 pool's probability weights are multiplied by before their e4m3 dot, and the output
divided by after: a power of two, so exact, that keeps a weight within e4m3's range (448) and lifts
the small ones above its subnormals."""


@triton.jit(do_not_specialize=["stride_tb", "stride_rb", "n_splits"])
def _decode_split_kernel(
    q_ptr,
    kv_ptr,
    table_ptr,
    n_slots_ptr,
    last_valid_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    count_ptr,
    rot_ptr,
    sc_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_tb,
    stride_rb,
    stride_ob,
    stride_oh,
    layer_off,
    stride_slot,
    stride_kv,
    stride_head,
    stride_tok,
    n_splits,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    C: tl.constexpr,
    CPI: tl.constexpr,
    D: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREC: tl.constexpr,
    DIRECT: tl.constexpr,
    FUSED: tl.constexpr,
    MERGE_G: tl.constexpr,
    MERGE_ROWS: tl.constexpr,
    PDL: tl.constexpr,
    SHIFTED: tl.constexpr,
    FP8: tl.constexpr,
    HEADS: tl.constexpr,
    HD: tl.constexpr,
    HR: tl.constexpr,
):
    if PDL:
        # Launched before the previous kernel ends (programmatic dependent launch): wait for its
        # writes (q, this token's K/V) before any load; let the next kernel launch behind this one.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(n_slots_ptr + b)
    lv = tl.load(last_valid_ptr + b)
    # The split count follows the table's width (a graph replays one launch for every length), but
    # the blocks are shared by what the sequence lists now: a table far wider than its sequence
    # (a budget of a whole GPU's pool) would otherwise leave all the work to its first splits.
    n_blocks = tl.cdiv(n, CPI)
    per_split = tl.cdiv(n_blocks, n_splits)
    blk_lo = s * per_split
    blk_hi = tl.minimum(blk_lo + per_split, n_blocks)

    GH: tl.constexpr = G * HEADS  # the query heads of the program's HEADS kv-heads
    PAIRED: tl.constexpr = (HD + HR) * 2 * BLOCK_G <= MAX_PAIRED_ACC  # fp8: `_attend_fp8_block`
    tl.static_assert(HEADS == 1 or (FP8 and CPI == 1 and not SHIFTED))
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = h * GH + g
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if HEADS > 1:  # block-diagonal: each query in its kv-head's D of the rows that stack the heads
        q = _stacked_query(q_row, 0, g, G, GH, D, HD)
    else:
        q = tl.load(q_row + d[None, :], mask=(g < G)[:, None], other=0.0)
    q_down = tl.full([BLOCK_G], 1.0, tl.float32)
    q_terms = 0.0
    q_terms2 = 0.0
    if FP8 and not SHIFTED:  # the query as two e4m3 terms, scaled by row: the larger fills e4m3
        q = q.to(tl.float32)
        amax = tl.max(tl.abs(q), 1)
        if HR > 0:  # the heads past the first HD rows: a second stack of HR rows
            q2 = _stacked_query(q_row, HD, g, G, GH, D, HR).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(q2), 1))
        up = E4M3_MAX / tl.where(amax > 0, amax, E4M3_MAX)  # 1 for a padding row of zeros
        q_down = 1.0 / up
        q_terms = _e4m3_terms(q * up[:, None], F32_DOT)
        if HR > 0:
            q_terms2 = _e4m3_terms(q2 * up[:, None], F32_DOT)
    elif not FP8:
        q = q.to(kv_ptr.dtype.element_ty)
    if F32_DOT:
        q = q.to(tl.float32)
    if SHIFTED:  # one chunk a block (CPI == 1): its keys move by their chunk's rotation
        hd = tl.arange(0, D // 2)
        q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh + hd[None, :]
        qa = tl.load(q_rows, mask=(g < G)[:, None], other=0.0).to(tl.float32)
        qb = tl.load(q_rows + D // 2, mask=(g < G)[:, None], other=0.0).to(tl.float32)
        rot_row = rot_ptr + b * stride_rb
    else:
        qa = 0.0
        qb = 0.0
        rot_row = 0.0
    k_base = kv_ptr + layer_off + h * HEADS * stride_head
    sc_base = sc_ptr
    if FP8:
        sc_base = sc_ptr + (layer_off + h * HEADS * stride_head) // 4  # the scale view starts C rows in
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    acc2 = 0.0
    if FP8:  # transposed: keys run down the dots' M (`_attend_fp8_block`), which sums by key
        l_i = tl.zeros([CPI * C, BLOCK_G], tl.float32)
        acc = tl.zeros([HD, 2 * BLOCK_G if PAIRED else BLOCK_G], tl.float32)
        if HR > 0:
            acc2 = tl.zeros([HR, 2 * BLOCK_G if PAIRED else BLOCK_G], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
    # Only the sequence's last block can hold unlisted chunks or unwritten tokens: the loop runs the
    # blocks before it without masks (a mask costs a compare and a select a score), then that one.
    last = n_blocks - 1
    for blk in range(blk_lo, tl.minimum(blk_hi, last)):
        m_i, l_i, acc, acc2 = _attend(
            q, q_terms, q_terms2, q_down, qa, qb, m_i, l_i, acc, acc2, blk, n, lv, table_ptr + b * stride_tb,
            rot_row, k_base, sc_base, qk_scale, stride_slot, stride_kv, stride_head, stride_tok,
            G, BLOCK_G, C, CPI, D, F32_DOT, PREC, SHIFTED, FP8, HEADS, HD, HR, PAIRED, False,
        )  # fmt: skip
    if (blk_lo <= last) & (blk_hi > last):
        m_i, l_i, acc, acc2 = _attend(
            q, q_terms, q_terms2, q_down, qa, qb, m_i, l_i, acc, acc2, last, n, lv, table_ptr + b * stride_tb,
            rot_row, k_base, sc_base, qk_scale, stride_slot, stride_kv, stride_head, stride_tok,
            G, BLOCK_G, C, CPI, D, F32_DOT, PREC, SHIFTED, FP8, HEADS, HD, HR, PAIRED, True,
        )  # fmt: skip
    if FP8:
        if PAIRED:  # the weights' two terms' columns
            acc = _sum_halves(acc)
            if HR > 0:
                acc2 = _sum_halves(acc2)
        if HEADS > 1:  # each query's output: its own head's D rows (the others met other heads' V)
            acc = _own_rows(acc, 0, g, G, D)
            if HR > 0:
                acc += _own_rows(acc2, HD, g, G, D)
        acc = tl.trans(acc)
        l_i = tl.sum(l_i, 0)
    seen = l_i > 0
    norm = l_i * FP8_P_UP if FP8 else l_i
    out = acc / tl.where(seen, norm, 1.0)[:, None]
    if DIRECT:
        out_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=(g < GH)[:, None])
    else:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        part = (b * tl.num_programs(1) * GH + heads) * n_splits + s
        tl.store(o_ptr + part[:, None] * D + d[None, :], out, mask=(g < GH)[:, None])
        tl.store(lse_ptr + part, lse, mask=g < GH)
        if FUSED:
            # One thread performs the scalar atomic, so a CTA barrier first orders every thread's
            # partial stores before its release (older Triton inserts none: triton-lang/triton#10816).
            # Its result reaches the other threads through shared memory behind a barrier, which
            # orders their merge loads after its acquire.
            tl.debug_barrier()
            row = b * tl.num_programs(1) + h
            if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == n_splits - 1:
                out_rows = out_ptr + b * stride_ob + h * GH * stride_oh
                _merge_splits(
                    o_ptr, lse_ptr, out_rows, stride_oh, row * GH, n_splits, GH, MERGE_G, MERGE_ROWS, D
                )
                tl.store(count_ptr + row, 0)


@triton.jit
def _attend(
    q, q_terms, q_terms2, q_down, qa, qb, m_i, l_i, acc, acc2, blk, n, lv, table_row, rot_row, k_base,
    sc_base, qk_scale, stride_slot, stride_kv, stride_head, stride_tok,
    G: tl.constexpr, BLOCK_G: tl.constexpr, C: tl.constexpr, CPI: tl.constexpr, D: tl.constexpr,
    F32_DOT: tl.constexpr, PREC: tl.constexpr, SHIFTED: tl.constexpr, FP8: tl.constexpr,
    HEADS: tl.constexpr, HD: tl.constexpr, HR: tl.constexpr, PAIRED: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block of CPI chunks folded into the running maximum `m_i`, sum `l_i` and output `acc`."""
    if FP8:
        m_i, l_i, acc, acc2 = _attend_fp8_block(
            q_terms, q_terms2, q_down, qa, qb, m_i, l_i, acc, acc2, blk, n, lv, table_row, rot_row, k_base,
            sc_base, qk_scale, stride_slot, stride_kv, stride_head, stride_tok,
            G, BLOCK_G, C, CPI, D, F32_DOT, PREC, SHIFTED, HEADS, HD, HR, PAIRED, MASKED,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _attend_block(
            q, qa, qb, m_i, l_i, acc, blk, n, lv, table_row, rot_row, k_base, qk_scale, stride_slot,
            stride_kv, stride_tok, C, CPI, D, F32_DOT, PREC, SHIFTED, MASKED,
        )  # fmt: skip
    return m_i, l_i, acc, acc2


@triton.jit
def _block_valid(blk, n, lv, C: tl.constexpr, CPI: tl.constexpr, MASKED: tl.constexpr):
    """Whether each token column of block `blk` holds a listed, written token (only the masked last
    block can hold others)."""
    t = tl.arange(0, CPI * C)
    ci = blk * CPI + t // C
    if MASKED:
        return (ci < n - 1) | ((ci == n - 1) & (t % C < lv))
    return tl.full([CPI * C], 1, tl.int1)


@triton.jit
def _block_slots(blk, n, lv, table_row, C: tl.constexpr, CPI: tl.constexpr, MASKED: tl.constexpr):
    """The slot of each token column of block `blk` and whether it holds a listed, written token."""
    ci = blk * CPI + tl.arange(0, CPI * C) // C
    if MASKED:
        slot = tl.load(table_row + ci, mask=ci < n, other=0).to(tl.int64)
    else:
        slot = tl.load(table_row + ci).to(tl.int64)
    return slot, _block_valid(blk, n, lv, C, CPI, MASKED)


@triton.jit
def _attend_block(
    q, qa, qb, m_i, l_i, acc, blk, n, lv, table_row, rot_row, k_base, qk_scale,
    stride_slot, stride_kv, stride_tok,
    C: tl.constexpr, CPI: tl.constexpr, D: tl.constexpr, F32_DOT: tl.constexpr, PREC: tl.constexpr,
    SHIFTED: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """A block of a 16- or 32-bit pool. Scores are scaled inside the exponent's multiply-add, so
    that a score costs a max, a multiply-add, an exp2 and a sum."""
    t = tl.arange(0, CPI * C)
    d = tl.arange(0, D)
    slot, valid = _block_slots(blk, n, lv, table_row, C, CPI, MASKED)
    rows = slot * stride_slot + (t % C) * stride_tok
    if SHIFTED:
        qk = _shifted_qk(
            qa, qb, rot_row + blk * D, k_base + rows[:, None], valid[:, None], D, F32_DOT, PREC, False
        )
    else:
        k = tl.load(k_base + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(k_base + stride_kv + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if F32_DOT:
        v = v.to(tl.float32)
    if not SHIFTED:  # the order of the measured kernel: both loads issued before the dot
        if F32_DOT:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    w = tl.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
    l_i = l_i * alpha + tl.sum(w, 1)
    acc = tl.dot(w.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _chunk_offsets(
    table_row, blk, n, t, stride_slot, C: tl.constexpr, CPI: tl.constexpr, MASKED: tl.constexpr
):
    """Each token column's slot offset in block `blk`, from one scalar load a chunk: the compiler
    then sees runs of C equal offsets, so a V^T row of a chunk is one contiguous run it copies 16
    bytes at a time (behind a vector of loaded slots it sees nothing and copies single bytes)."""
    off = tl.zeros([CPI * C], tl.int64)
    for j in tl.static_range(CPI):
        ci = blk * CPI + j
        if MASKED:
            slot = tl.load(table_row + ci, mask=ci < n, other=0)
        else:
            slot = tl.load(table_row + ci)
        off = tl.where(t // C == j, slot.to(tl.int64) * stride_slot, off)
    return off


@triton.jit
def _attend_fp8_block(
    q_terms, q_terms2, q_down, qa, qb, m_i, l_i, acc, acc2, blk, n, lv, table_row, rot_row, k_base,
    sc_base, qk_scale, stride_slot, stride_kv, stride_head, stride_tok,
    G: tl.constexpr, BLOCK_G: tl.constexpr, C: tl.constexpr, CPI: tl.constexpr, D: tl.constexpr,
    F32_DOT: tl.constexpr, PREC: tl.constexpr, SHIFTED: tl.constexpr, HEADS: tl.constexpr,
    HD: tl.constexpr, HR: tl.constexpr, PAIRED: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """A block of an fp8 pool, transposed: keys are the dots' M, so that both tiles reach e4m3
    tensor-core dots as they are stored (K [T, D] and V^T [D, T], both contiguous along the dots'
    inner dimension), with no widening in shared memory. S^T = K q^T takes the query as two e4m3
    terms side by side (`q_terms` [D, 2G]: a value and its remainder, scaled up by row; `q_down`
    undoes it), about bf16's precision; the weights W^T = P^T x FP8_P_UP (x each token's V scale
    over the block's largest, for blocks of several chunks) meet V^T as two e4m3 terms side by side
    as well, and acc^T [D, 2G] (the terms' columns, added after the loop) takes the block's V
    scale once. `l_i` [T, G] sums the unscaled weights by key, over the keys once after the loop:
    a sum across the keys each tile would cross the warps (shared memory and barriers) as the
    maximum must. `acc` carries FP8_P_UP, which the caller divides out with the sum. With
    `F32_DOT` (the interpreter) the same e4m3 terms meet fp32 dots."""
    t = tl.arange(0, CPI * C)
    d = tl.arange(0, D)
    valid = _block_valid(blk, n, lv, C, CPI, MASKED)
    g = tl.arange(0, BLOCK_G)
    k2 = 0.0
    v2 = 0.0
    if CPI == 1:  # one slot: tile addresses the compiler sees as contiguous, in 16-byte copies
        slot_off = tl.load(table_row + blk).to(tl.int64) * stride_slot
        k_rows = k_base + slot_off + t * stride_tok
        v_cols = k_base + stride_kv + slot_off + t
        if HEADS > 1:  # HEADS kv-heads stacked along the dots' inner dimension (HD + HR rows)
            k, v = _stacked_tiles(k_rows, v_cols, valid, 0, stride_head, C, D, HD)
            if HR > 0:
                k2, v2 = _stacked_tiles(k_rows, v_cols, valid, HD, stride_head, C, D, HR)
            sc_col = sc_base + (slot_off + (g // G) * stride_head) // 4  # each query's own head's
            k_sc = tl.load(sc_col, mask=g < G * HEADS, other=0.0)
            vs = tl.load(sc_col + stride_kv // 4, mask=g < G * HEADS, other=0.0)[None, :]
        else:
            sc_one = sc_base + slot_off // 4
            k_sc = tl.load(sc_one)
            vs = tl.load(sc_one + stride_kv // 4)
    else:
        slot_off = _chunk_offsets(table_row, blk, n, t, stride_slot, C, CPI, MASKED)
        k_rows = k_base + slot_off + (t % C) * stride_tok
        v_cols = k_base + stride_kv + slot_off + t % C
        sc_rows = sc_base + slot_off // 4
        k_sc = tl.load(sc_rows, mask=valid, other=0.0)
        v_sc = tl.load(sc_rows + stride_kv // 4, mask=valid, other=0.0)
    if SHIFTED:
        qk = tl.trans(
            _shifted_qk(qa, qb, rot_row + blk * D, k_rows[:, None], valid[:, None], D, F32_DOT, PREC, True)
        )
    elif HEADS == 1:
        k = tl.load(k_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    if HEADS == 1:
        v = tl.load(v_cols[None, :] + d[:, None] * C, mask=valid[None, :], other=0.0)  # V^T [D, T]
    if not SHIFTED:
        qk = _dot(k, q_terms, None, F32_DOT, PREC)
        if HR > 0:
            qk = _dot(k2, q_terms2, qk, F32_DOT, PREC)
        qk = _sum_halves(qk)  # [T, G]
    scale = qk_scale * q_down
    if CPI == 1:  # a scalar, or with HEADS each query's head's
        scale = scale * k_sc
    else:
        qk = qk * k_sc[:, None]
    if MASKED:
        qk = tl.where(valid[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 0) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(tl.fma(qk, scale[None, :], -m_new[None, :]))
    l_i = l_i * alpha[None, :] + p
    if CPI == 1:
        w = p * FP8_P_UP
    else:
        vs = tl.max(v_sc, 0)
        w = p * (v_sc * (FP8_P_UP / tl.maximum(vs, 1.0e-30)))[:, None]
    if CPI * C < 32:  # an e4m3 dot needs 32 keys: fewer meet V^T widened, the weights in fp16
        w_hi = w.to(tl.float16)
        w_lo = tl.zeros_like(w_hi)
        if not F32_DOT:
            v = v.to(tl.float16)
    else:
        w_hi = _nearest_e4m3(w, F32_DOT)
        w_lo = _nearest_e4m3(w - w_hi.to(tl.float32), F32_DOT)
    if PAIRED:  # acc^T holds both terms' columns (`_side_by_side`), added after the loop
        alpha = _side_by_side(alpha[None, :], alpha[None, :])
        if HEADS > 1:  # each query's head's scale, for the columns of both terms
            vs = _side_by_side(vs, vs)
    else:
        alpha = alpha[None, :]
    acc = acc * alpha + _weighted(v, w_hi, w_lo, F32_DOT, PREC, PAIRED) * vs
    if HR > 0:
        acc2 = acc2 * alpha + _weighted(v2, w_hi, w_lo, F32_DOT, PREC, PAIRED) * vs
    return m_new, l_i, acc, acc2


@triton.jit
def _weighted(v, w_hi, w_lo, F32_DOT: tl.constexpr, PREC: tl.constexpr, PAIRED: tl.constexpr):
    """V^T times the weights' two terms: side by side in one dot (`PAIRED`), or a dot each, added."""
    if PAIRED:
        part = _dot(v, _side_by_side(w_hi, w_lo), None, F32_DOT, PREC)
    else:
        part = _dot(v, w_lo, _dot(v, w_hi, None, F32_DOT, PREC), F32_DOT, PREC)
    return part


@triton.jit
def _stacked_query(q_row, row0, g, G: tl.constexpr, GH: tl.constexpr, D: tl.constexpr, R: tl.constexpr):
    """Rows row0 .. row0 + R of a stack of kv-heads, D rows each, as the block-diagonal query
    [BLOCK_G, R]: query g holds its values in its own kv-head's D columns, zeros elsewhere."""
    r = row0 + tl.arange(0, R)
    own = (g < GH)[:, None] & (r[None, :] // D == g[:, None] // G)
    return tl.load(q_row + (r % D)[None, :], mask=own, other=0.0)


@triton.jit
def _stacked_tiles(
    k_rows, v_cols, valid, row0, stride_head, C: tl.constexpr, D: tl.constexpr, R: tl.constexpr
):
    """K [T, R] and V^T [R, T] of rows row0 .. row0 + R of a block's stacked kv-heads, D rows a head."""
    r = row0 + tl.arange(0, R)
    at = (r // D) * stride_head
    k = tl.load(k_rows[:, None] + (at + r % D)[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_cols[None, :] + (at + (r % D) * C)[:, None], mask=valid[None, :], other=0.0)
    return k, v


@triton.jit
def _own_rows(acc, row0, g, G: tl.constexpr, D: tl.constexpr):
    """acc^T [R, BLOCK_G] of rows row0 .. row0 + R of the stacked heads, each query's own head's D
    rows kept (the others met other heads' V) and summed into [D, BLOCK_G]."""
    r = row0 + tl.arange(0, acc.shape[0])
    acc = tl.where(r[:, None] // D == g[None, :] // G, acc, 0.0)
    return tl.sum(tl.reshape(acc, [acc.shape[0] // D, D, acc.shape[1]]), 0)


@triton.jit
def _e4m3_terms(x, F32_DOT: tl.constexpr):
    """x [G, R] (fp32 within ±448) as its two e4m3 terms, a value and its remainder, transposed
    side by side: [R, 2G]."""
    hi = _nearest_e4m3(x, F32_DOT)
    return _side_by_side(tl.trans(hi), tl.trans(_nearest_e4m3(x - hi.to(tl.float32), F32_DOT)))


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr, PREC: tl.constexpr):
    """acc + a b, a tensor-core dot of e4m3 (or fp16) operands; with `F32_DOT` (the interpreter)
    of the same values in fp32."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)
    return tl.dot(a, b, acc)


@triton.jit
def _side_by_side(a, b):
    """Two [R, N] terms as one [R, 2N] dot operand, a's columns then b's: one dot then reads the
    large operand (K or V^T) from shared memory once for both terms, and the two results stay in
    one thread's registers (a wgmma accumulator's columns c and c + N, N >= 8, are the same
    thread's), where `_sum_halves` adds them. The terms are joined as fp32 and narrowed back
    (exact): Triton 3.6 compiled the query's two e4m3 terms, joined as e4m3, into a wgmma operand
    that gave wrong products on sm_90 (`test_gpu_decode_fp8`, where the interpreter passed)."""
    j = tl.join(a.to(tl.float32), b.to(tl.float32))
    return tl.reshape(tl.permute(j, (0, 2, 1)), (a.shape[0], 2 * a.shape[1])).to(a.dtype)


@triton.jit
def _sum_halves(x):
    """The two [R, N] halves of x [R, 2N] added: the terms `_side_by_side` put side by side."""
    a, b = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))
    return a + b


@triton.jit
def _nearest_e4m3(x, F32_DOT: tl.constexpr):
    """x (fp32, within ±448) rounded to the nearest e4m3: the GPU's conversion, or where the
    interpreter runs (`F32_DOT`) `to_e4m3`'s bit arithmetic, as the interpreter's own truncates."""
    if F32_DOT:
        return to_e4m3(x, 1.0)
    return x.to(tl.float8e4nv)


@triton.jit
def _shifted_qk(
    qa,
    qb,
    rot_row,
    k_rows,
    mask,
    D: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREC: tl.constexpr,
    FP8: tl.constexpr,
):
    """q . R(s) k over one chunk's keys, as R(-s) q . k: the query halves qa, qb (fp32) turned back
    by the chunk's rotation (cos, sin at rot_row: 2 x D/2 fp32), then one dot per half of the keys
    (fp8 keys: unscaled, widened to fp16)."""
    hd = tl.arange(0, D // 2)
    cos = tl.load(rot_row + hd)[None, :]
    sin = tl.load(rot_row + D // 2 + hd)[None, :]
    ka = tl.load(k_rows + hd[None, :], mask=mask, other=0.0)
    kb = tl.load(k_rows + D // 2 + hd[None, :], mask=mask, other=0.0)
    ra = qa * cos + qb * sin
    rb = qb * cos - qa * sin
    if F32_DOT:
        ka = ka.to(tl.float32)
        kb = kb.to(tl.float32)
    elif FP8:
        ka = ka.to(tl.float16)
        kb = kb.to(tl.float16)
        ra = ra.to(tl.float16)
        rb = rb.to(tl.float16)
    else:
        ra = ra.to(ka.dtype)
        rb = rb.to(kb.dtype)
    return tl.dot(ra, tl.trans(ka), input_precision=PREC) + tl.dot(rb, tl.trans(kb), input_precision=PREC)


@triton.jit
def _merge_splits(
    o_ptr,
    lse_ptr,
    out_ptr,
    stride_oh,
    row0,
    n_splits,
    G: tl.constexpr,
    MERGE_G: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
):
    """Merges the partials of heads row0 .. row0 + G - 1 by their log-sum-exp into out_ptr's G rows,
    ROWS splits at a time with an online maximum, so any split count fits in registers."""
    g = tl.arange(0, MERGE_G)
    ss = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    m = tl.full([MERGE_G], -1.0e30, tl.float32)
    total = tl.zeros([MERGE_G], tl.float32)
    acc = tl.zeros([MERGE_G, D], tl.float32)
    for s0 in range(0, n_splits, ROWS):
        part = (row0 + g[:, None]) * n_splits + s0 + ss[None, :]
        ok = (g < G)[:, None] & (s0 + ss < n_splits)[None, :]
        lse = tl.load(lse_ptr + part, mask=ok, other=float("-inf"))
        o = tl.load(o_ptr + part[:, :, None] * D + d[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])
        total = total * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    out = (acc / tl.where(total > 0, total, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + g[:, None] * stride_oh + d[None, :], out, mask=(g < G)[:, None])


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    n_splits,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    COLS: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    d = tl.program_id(2) * COLS + tl.arange(0, COLS)
    # One pass with an online maximum: each step loads its splits' lse and partials together, so
    # the merge costs one round trip to memory per ROWS splits, not a max pass and then a sum pass.
    m = tl.full((), -1.0e30, tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, n_splits, ROWS):
        ss = s0 + tl.arange(0, ROWS)
        lse = tl.load(lse_ptr + row * n_splits + ss, mask=ss < n_splits, other=float("-inf"))
        o = tl.load(
            o_part_ptr + (row * n_splits + ss)[:, None] * D + d[None, :],
            mask=(ss < n_splits)[:, None],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


class Launch(NamedTuple):
    block_tokens: int
    """Tokens per loop iteration."""
    stages: int
    waves: float
    """Programs per resident slot of the device: sets the split count (`decode_splits`)."""
    fused: bool
    """The last program of each (sequence, kv-head) merges the splits, instead of a second kernel."""
    warps: int = 4
    """Warps a program."""
    max_registers: int | None = None
    """Registers a thread may take at most (ptxas' maxnreg), None: as many as the compiler wants.
    Registers set how many programs an SM holds at once, and so the bytes it keeps in flight. Only
    a program of several kv-heads (`decode_heads`) takes it (`decode_grid`): the cap is measured for
    that program, and a cap above what a smaller program takes raises its count instead."""


def decode_launch(head_dim: int, batch: int, kv_bytes: int = 2) -> Launch:
    """Launch settings for a shape, each rule measured side by side with what it replaced
    (bench/decode_tune.py and docs/BENCHMARKS.md: Kernels, "Decode launch rules and why").
    At batch 1-8, head_dim 128 streams best from one program per SM (`waves` 1 at one 128-token tile
    per SM), its tiles five stages deep, merged in the split kernel: one ramp-up per SM instead of
    four, and with so few splits the merging program reads little. Four stages are slower (the
    compiled kernel holds 72 KB of shared memory, five 137 KB). Only 2-byte KV takes it: fp32 tiles
    twice the size would not fit in shared memory five deep.
    From batch 16 the (b, kv-head) programs alone fill the device and 64-token tiles are best, and
    head_dim 128 merges in the split kernel: over two waves at batch 16-31, six from batch 32.
    head_dim 64 keeps the two-kernel merge below batch 16 (the fused merge is slower there at every
    split count tried) and takes 128-token tiles from batch 2; at batch 2-8 five stages deep in one
    wave of two programs per SM. An fp8 pool takes 64-token tiles (one chunk a block: its V^T tile
    is then one contiguous run a channel) and four warps, the warpgroup its e4m3 tensor-core dots
    need (eight are far slower), merged in the split kernel from batch 16. Head_dim 64 goes two
    stages deep over three waves with a thread's registers capped at 160: the stacked program
    (`decode_heads`) then fits three an SM instead of two (198 registers uncapped), 9-11 points of
    copy bandwidth more at batch 16 and 64, where uncapped it was best over one or two waves and
    a cap over fewer waves loses (a program of one kv-head runs uncapped over the same three waves,
    not measured apart); at batch 16-31 it takes 128-token tiles (two chunks), as its 64-token
    tile costs the fixed work a tile has (the cross-warp max and sum, the weights' trip through
    shared memory) for half of head_dim 128's bytes; at batch 64 they lose. Head_dim 128 splits over
    three waves: a program of one kv-head, two stages deep, reads at 58-90 % of copy as the split
    count moves with the batch and the waves (12 splits at batch 16 the best swept); from batch 32
    a program of two kv-heads (`decode_heads`), four stages deep, holds 86-89 % at every split
    count swept. Below batch 16 an fp8 pool keeps the bf16 rules' waves and merge, untuned. A program
    that serves several kv-heads walks one chunk a block whatever the tile here."""
    if kv_bytes == 1 and head_dim >= 128 and batch >= 16:
        return Launch(BLOCK_TOKENS, 4 if batch >= STACK_FROM_BATCH else 2, 3, True)
    if kv_bytes == 1 and batch >= 16:
        return Launch(2 * BLOCK_TOKENS if batch < 32 else BLOCK_TOKENS, 2, 3, True, max_registers=160)
    if kv_bytes == 1:
        return Launch(BLOCK_TOKENS, 2, WAVES, False)
    if head_dim >= 128 and batch >= 16:
        return Launch(BLOCK_TOKENS, 2, 2 if batch < 32 else 6, True)
    if batch >= 16:
        return Launch(BLOCK_TOKENS, 2, WAVES, False)
    if head_dim >= 128 and batch <= 8 and kv_bytes <= 2:
        return Launch(128, 5, 1, True)
    if head_dim >= 128:
        return Launch(128, 3, WAVES * (1 if batch == 1 else 2), False)
    if batch == 1:
        return Launch(BLOCK_TOKENS, 2, WAVES, False)
    if batch <= 8 and kv_bytes <= 2:
        return Launch(128, 5, 1, False)
    return Launch(2 * BLOCK_TOKENS, 2, WAVES, False)


def decode_heads(
    h_kv: int, group: int, head_dim: int, chunk: int, kv_bytes: int, rotated: bool, batch: int = 1
) -> int:
    """kv-heads one program serves. An fp8 pool's program of head_dim 64 and a small query group
    spends most of its issue slots on a tile's fixed work (the cross-warp maximum, the weights' trip
    through shared memory), the same for one query or sixteen: stacking several kv-heads' tiles along
    the dots' inner dimension (the queries block-diagonal, MAX_GROUP_ROWS of them at most, so one
    [T, 16] softmax serves them all) spreads that work over their bytes. At head_dim 128 that work is
    a smaller share, and stacking pays from STACK_FROM_BATCH sequences, where a program of one head
    reads well only at some split counts (`decode_launch`). Unrotated chunks of BLOCK_TOKENS only
    (one chunk a block, so each head's scales are a scalar); the heads a program takes divide the
    pool's, MAX_STACKED_ROWS rows at most, as two stacks of a power of two heads each (3 = 2 + 1:
    tile sizes are powers of two, and a padding head would cost the dots a quarter of their work)."""
    if kv_bytes != 1 or rotated or chunk != BLOCK_TOKENS or (head_dim >= 128 and batch < STACK_FROM_BATCH):
        return 1
    fits = (
        p
        for p in range(h_kv, 0, -1)
        if h_kv % p == 0
        and p * group <= MAX_GROUP_ROWS
        and p * head_dim <= MAX_STACKED_ROWS
        and (pow2(p) or pow2(p - prev_pow2(p)))  # one stack, or a second of a power of two
    )
    return next(fits)


class Grid(NamedTuple):
    heads: int
    """kv-heads a program (`decode_heads`)."""
    cpi: int
    """Chunks a block."""
    splits: int
    """Splits per (sequence, program's kv-heads) (`decode_splits`)."""
    max_registers: int | None
    """The launch's register cap where the program serves several kv-heads (`Launch.max_registers`)."""


def decode_grid(
    kv_pool: torch.Tensor,
    batch: int,
    hq: int,
    width: int,
    rotated: bool,
    device: torch.device,
    block_tokens: int | None = None,
    heads: int | None = None,
    waves: float | None = None,
) -> Grid:
    """What a launch over a slot table `width` chunks wide walks: the kv-heads a program serves,
    the chunks a block, the split count and the register cap, each the rule's unless given
    (bench/decode_tune.py sweeps them through here, as the launcher takes them)."""
    h_kv, c, d, kv_bytes = kv_pool.shape[3], chunk_tokens(kv_pool), kv_pool.shape[5], kv_pool.element_size()
    tuned = decode_launch(d, batch, kv_bytes)
    heads = heads or decode_heads(h_kv, hq // h_kv, d, c, kv_bytes, rotated, batch)
    assert h_kv % heads == 0 and (heads == 1 or (kv_bytes == 1 and not rotated and c == BLOCK_TOKENS))
    cpi = 1 if rotated or heads > 1 else max(1, (block_tokens or tuned.block_tokens) // c)
    tile_bytes = 2 * cpi * c * d * heads * kv_bytes
    splits = decode_splits(
        triton.cdiv(width, cpi), tile_bytes, batch, h_kv // heads, device, waves or tuned.waves
    )
    return Grid(heads, cpi, splits, tuned.max_registers if heads > 1 else None)


def use_pdl(head_dim: int, device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper on): a kernel is scheduled while the previous one in the
    stream drains and waits for its writes on the device, instead of launching after it. It pays
    for head_dim 64 (short kernels, where a launch gap is a visible share) and not for head_dim 128,
    so only head_dim 64 takes it (docs/BENCHMARKS.md: Kernels, "Decode launch rules and why")."""
    return head_dim < 128 and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def decode_splits(
    max_blocks: int, tile_bytes: int, batch: int, n_kv_heads: int, device: torch.device, waves: float = WAVES
) -> int:
    """Splits per (sequence, kv-head): up to `waves` programs per resident slot of the device, none
    shorter than MIN_BLOCKS_PER_SPLIT blocks. Rounded down, so that one wave (8 kv-heads on 132 SMs:
    16 splits, not 17) never spills a few programs into a second. Sized by the table width, so no
    host sync is needed."""
    resident = sm_count(device) * max(1, TILE_BYTES_PER_SM // tile_bytes)
    want = int(waves * resident) // (batch * n_kv_heads)
    return max(1, min(want, triton.cdiv(max_blocks, MIN_BLOCKS_PER_SPLIT), MAX_SPLITS))


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on `device`, shared by every fused launch there: each launch
    leaves them zero again, so no memset is needed. Launches on one device must not overlap (decode
    runs on one stream), and a call that needs more than COUNTERS must not be the first during a CUDA
    graph capture."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
            "arrival counters cannot grow during CUDA graph capture"
        )
        buf = _counters[device] = torch.zeros(max(n, COUNTERS), dtype=torch.int32, device=device)
    return buf


def warm_decode(kv_pool: torch.Tensor, hq: int, dtype: torch.dtype, max_batch: int, width: int) -> None:
    """Launches the kernel once per batch size up to `max_batch`, keys rotated or not, on scratch
    queries over slot 0 (read only): each launch rule and split count a batch can meet compiles
    now (kernels.warm_decode says why)."""
    d, dev = kv_pool.shape[5], kv_pool.device
    q = torch.zeros(max_batch, hq, d, dtype=dtype, device=dev)
    table = torch.zeros(max_batch, width, dtype=torch.int32, device=dev)
    one = torch.ones(max_batch, dtype=torch.int32, device=dev)
    rot = torch.zeros(max_batch, width, 2, d // 2, dtype=torch.float32, device=dev)
    for b in range(1, max_batch + 1):
        for r in (None, rot[:b]):
            paged_decode_attention(q[:b], kv_pool, 0, table[:b], one[:b], one[:b], 1.0, rot=r)


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_table: torch.Tensor,
    n_slots: torch.Tensor,
    last_valid: torch.Tensor,
    sm_scale: float,
    *,
    fused: bool | None = None,
    n_splits: int | None = None,
    block_tokens: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    pdl: bool | None = None,
    heads: int | None = None,
    max_registers: int | None = None,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention. The keywords override `decode_launch` and
    `decode_splits` (bench/decode_tune.py sweeps them all); `fused` merges the splits in the split
    kernel (the last arrival of each (sequence, kv-head)) instead of a second kernel; `pdl` launches
    both kernels as programmatic dependent launches (`use_pdl`); `heads` is the kv-heads a program
    serves (`decode_heads`); `max_registers` caps the split kernel's registers a thread
    (`Launch.max_registers`). With `rot` [B, W, 2, D/2] fp32 the kernel walks one chunk a block,
    turning the query by each chunk's rotation."""
    b, hq, d = q.shape
    h_kv, c = kv_pool.shape[3], chunk_tokens(kv_pool)
    assert q.stride(2) == 1 and slot_table.stride(1) == 1, "q and slot_table rows must be contiguous"
    g = hq // h_kv
    tuned = decode_launch(d, b, kv_pool.element_size())
    fused = tuned.fused if fused is None else fused
    pdl = use_pdl(d, q.device) if pdl is None else pdl
    heads, cpi, splits, regs = decode_grid(
        kv_pool, b, hq, slot_table.shape[1], rot is not None, q.device, block_tokens, heads
    )
    splits = n_splits or splits
    if rot is not None:
        assert (
            rot.dtype == torch.float32
            and rot.is_contiguous()
            and rot.shape[1:] == (slot_table.shape[1], 2, d // 2)
        )
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    direct = splits == 1
    o_part = lse = counters = None
    if not direct:
        o_part = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
        if fused:
            counters = arrival_counters(q.device, b * h_kv // heads)
    merge_g = next_pow2(g * heads)
    merge_rows = min(next_pow2(splits), max(1, MERGE_ELEMS // (merge_g * d))) if fused else 1
    layer_off, s_slot, s_kv, s_head, s_tok = pool_strides(kv_pool, layer)
    _decode_split_kernel[(b, h_kv // heads, splits)](
        q,
        kv_pool,
        slot_table,
        n_slots,
        last_valid,
        o_part,
        lse,
        out,
        counters,
        rot,
        fp8_scales(kv_pool) if is_fp8(kv_pool) else None,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        slot_table.stride(0),
        0 if rot is None else rot.stride(0),
        out.stride(0),
        out.stride(1),
        layer_off,
        s_slot,
        s_kv,
        s_head,
        s_tok,
        splits,
        G=g,
        BLOCK_G=max(MAX_GROUP_ROWS // (2 if is_fp8(kv_pool) and rot is None else 1), next_pow2(g * heads)),
        C=c,
        CPI=cpi,
        D=d,
        F32_DOT=f32_dot(q),
        PREC=dot_precision(kv_pool.dtype),
        DIRECT=direct,
        FUSED=fused,
        MERGE_G=merge_g,
        MERGE_ROWS=merge_rows,
        PDL=pdl,
        SHIFTED=rot is not None,
        FP8=is_fp8(kv_pool),
        HEADS=heads,
        HD=prev_pow2(heads) * d,
        HR=(heads - prev_pow2(heads)) * d,
        num_warps=num_warps or tuned.warps,
        num_stages=num_stages or tuned.stages,
        maxnreg=max_registers or regs,
        launch_pdl=pdl,
    )
    if direct or fused:
        return out
    cols = min(d, COMBINE_COLS)
    _combine_kernel[(b, hq, d // cols)](
        o_part,
        lse,
        out,
        splits,
        out.stride(0),
        out.stride(1),
        D=d,
        COLS=cols,
        ROWS=min(COMBINE_ROWS, next_pow2(splits)),
        PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out
