"""Torch reference twins of the Triton kernels: plain, exact (fp32 math), device-agnostic.

They define what each kernel computes. The pool is `[n_slots, n_layers, 2, Hkv, C, D]` (0 = K, 1 = V,
K post-RoPE). Query head h reads kv-head h // (Hq // Hkv). Positions that no query may see are zeroed
before use, so stale or poisoned bytes in unused slot positions never leak in (0 * NaN is NaN).

An fp8 pool (e4m3fn) has C + 1 rows per (layer, K/V, kv-head) block, the last holding the block's
fp32 scale (`_common.fp8_scales`): a value is its e4m3 byte times the scale (`kv_values`), and
`write_tokens` sets the scales (`FP8_HEADROOM` says how). A V block's C rows hold its bytes
channel-major (`_common.fp8_v_tokens`), a K block's token-major.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvflash.kernels._common import (
    FP8,
    FP8_HEADROOM,
    FP8_MAX,
    chunk_tokens,
    fp8_scales,
    fp8_v_tokens,
    is_fp8,
)
from kvflash.models.rope import apply_rotary


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [..., Hq, M, D], k/v [..., Hkv, N, D], mask broadcastable to [..., Hq, M, N]; fp32 out.
    Each kv-head's query group is one [G * M, D] block against its K and V, which are never
    repeated per query head (a wide table's gathered KV would take G times its memory)."""
    *lead, hq, m, d = q.shape
    hkv, n = k.shape[-3:-1]
    g = hq // hkv
    qg = q.float().reshape(*lead, hkv, g * m, d)
    mask = mask.expand(*lead, hq, m, n).reshape(*lead, hkv, g * m, n)
    scores = (qg @ k.float().transpose(-1, -2)) * scale
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v.float()
    return out.reshape(*lead, hq, m, v.shape[-1])


def kv_values(kv: torch.Tensor) -> torch.Tensor:
    """K and V blocks `[..., 2, Hkv, rows, D]` of a pool as values `[..., 2, Hkv, C, D]` in token
    order: as they are, or for fp8 each block's values (`block_values`), V's read channel-major."""
    if not is_fp8(kv):
        return kv
    k, v = kv.unbind(-4)
    return torch.stack([block_values(k), fp8_v_tokens(block_values(v))], -4)


def block_values(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks `[..., rows, D]` of a pool as values `[..., C, D]` in the order they are held: as they
    are, or for fp8 the C rows in fp32 times their block's scale. For K blocks that is token order."""
    if not is_fp8(blocks):
        return blocks
    return blocks[..., :-1, :].float() * fp8_scales(blocks)[..., None, None]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32, clamped to ±448 and rounded to the nearest e4m3fn (ties to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_whole_chunks(values: torch.Tensor, out: torch.Tensor) -> None:
    """Values `[..., 2, Hkv, C, D]` (K and V in token order) into fp8 blocks `out` `[..., 2, Hkv,
    C + 1, D]` as a prefill writes whole chunks: each block scaled by its largest finite magnitude
    / 448 (`fp8_scale`), K's bytes token-major, V's channel-major (`fp8_v_tokens`)."""
    scale = fp8_scale(values.float().nan_to_num(0).abs().amax((-2, -1)), whole=True)
    fp8_scales(out).copy_(scale)
    q = quantize_fp8(values, scale[..., None, None])
    out[..., 0, :, :-1, :] = q[..., 0, :, :, :]
    fp8_v_tokens(out[..., 1, :, :-1, :])[:] = q[..., 1, :, :, :]


def fp8_scale(amax: torch.Tensor, whole: bool) -> torch.Tensor:
    """The scale of a block whose first write's largest magnitude is amax: amax / 448 when the write
    holds the whole chunk, FP8_HEADROOM times that otherwise; 1 for an all-zero write."""
    mul = (1.0 if whole else FP8_HEADROOM) / FP8_MAX
    return torch.where(amax > 0, amax.float() * mul, 1.0)


def shift_keys(k: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Keys k [..., n, C, D] of n chunks moved by each chunk's RoPE rotation rot [..., n, 2, D/2]
    (cos, sin of shift * inverse frequency): key positions as if the chunks between were absent."""
    cos = torch.cat([rot[..., 0, :]] * 2, -1)[..., None, :]
    sin = torch.cat([rot[..., 1, :]] * 2, -1)[..., None, :]
    kf, half = k.float(), k.shape[-1] // 2
    return kf * cos + torch.cat([-kf[..., half:], kf[..., :half]], -1) * sin


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_table: torch.Tensor,
    n_slots: torch.Tensor,
    last_valid: torch.Tensor,
    sm_scale: float,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence b over its first n_slots[b] listed slots; only the first
    last_valid[b] tokens of the last listed slot (the append head) are valid. Returns [B, Hq, D].
    rot [B, max_n, 2, D/2], when given, moves each listed chunk's keys (`shift_keys`)."""
    b, _, d = q.shape
    c = chunk_tokens(kv_pool)
    max_n = slot_table.shape[1]
    listed = torch.arange(max_n, device=q.device)[None, :] < n_slots[:, None]  # [B, max_n]
    slots = torch.where(listed, slot_table, 0).long()
    tok = torch.arange(max_n * c, device=q.device)[None, :]
    valid = tok < ((n_slots - 1) * c + last_valid)[:, None]  # [B, max_n * C]
    kv = kv_values(kv_pool[slots, layer])  # [B, max_n, 2, Hkv, C, D]
    if rot is not None:
        kv = kv.float()
        kv[:, :, 0] = shift_keys(kv[:, :, 0].transpose(1, 2), rot[:, None]).transpose(1, 2)
    kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, kv.shape[3], max_n * c, d)
    kv.masked_fill_(~valid[None, :, None, :, None], 0)  # kv is a gathered copy, not the pool
    out = _attend(q[:, :, None, :], kv[0], kv[1], valid[:, None, None, :], sm_scale)
    return out[:, :, 0].to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    q_start: int,
    sm_scale: float,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query t sits at position q_start + t; key j of listed slot i at chunk_index[i] * C + j; causal.
    Returns [T, Hq, D]. rot [n, 2, D/2], when given, moves each listed chunk's keys (`shift_keys`)."""
    t, _, d = q.shape
    c = chunk_tokens(kv_pool)
    key_pos = (chunk_index.long()[:, None] * c + torch.arange(c, device=q.device)).flatten()
    q_pos = q_start + torch.arange(t, device=q.device)
    kv = kv_values(kv_pool[slots.long(), layer])  # [n, 2, Hkv, C, D]
    if rot is not None:
        kv = kv.float()
        kv[:, 0] = shift_keys(kv[:, 0].transpose(0, 1), rot).transpose(0, 1)
    kv = kv.permute(1, 2, 0, 3, 4).reshape(2, kv.shape[2], -1, d)
    kv = torch.where((key_pos < q_start + t)[None, None, :, None], kv, 0)
    mask = key_pos[None, :] <= q_pos[:, None]
    out = _attend(q.transpose(0, 1), kv[0], kv[1], mask, sm_scale)
    return out.transpose(0, 1).to(q.dtype)


def prefill_attention_batched(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    pieces: torch.Tensor,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    max_t: int,
    sm_scale: float,
) -> torch.Tensor:
    """Several pieces' `prefill_attention` at once: q [T, Hq, D] holds their rows, and piece i's
    row of pieces [P, 5] int32 is (first row, rows, first position, first listed, listed): its
    queries attend over slots/chunk_index[first listed : first listed + listed]. max_t is the most
    rows a piece has. Keys are not rotated."""
    out = torch.empty_like(q)
    for lo, t, q_start, first, n in pieces.tolist():
        listed = slice(first, first + n)
        out[lo : lo + t] = prefill_attention(
            q[lo : lo + t], kv_pool, layer, slots[listed], chunk_index[listed], q_start, sm_scale
        )
    return out


def chunk_summaries(kv_pool: torch.Tensor, slots: torch.Tensor, blocks: int) -> torch.Tensor:
    """[n, L, Hkv, blocks, D] fp32: the mean key of each of `blocks` equal runs of tokens of each listed
    chunk (call on full chunks only)."""
    keys = block_values(kv_pool[slots.long(), :, 0]).float()  # [n, L, Hkv, C, D]
    n, layers, h_kv, c, d = keys.shape
    return keys.view(n, layers, h_kv, blocks, c // blocks, d).mean(4)


def chunk_lse(
    q: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """log Σ exp(q·k / √D) over the C keys of each listed chunk, for every layer's queries:
    q [L, T, Hq, D] -> [L, T, Hq, n] fp32 (query head h reads kv-head h // (Hq // Hkv)). rot [n, 2, D/2],
    when given, moves each chunk's keys (`shift_keys`). Call on full chunks only."""
    layers, t, hq, d = q.shape
    keys = block_values(kv_pool[slots.long(), :, 0])  # [n, L, Hkv, C, D]
    if rot is not None:
        keys = shift_keys(keys.movedim(0, 2), rot).movedim(2, 0)
    qs = q.float().view(layers, t, keys.shape[2], -1, d)
    logits = torch.einsum("lthgd,nlhcd->lthgnc", qs, keys.float()) * d**-0.5
    return logits.logsumexp(-1).flatten(2, 3)


def write_tokens(
    kv_pool: torch.Tensor,
    layer: int,
    slot: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Stores token t's K/V [Hkv, D] at position offset[t] of slot slot[t], in place.

    fp8: a token at offset 0 leads the run of tokens after it that fill the same chunk in order; the
    run's largest magnitude per (K/V, kv-head) sets the chunk's scales (`fp8_scale`), before any
    token is stored. Tokens whose chunk no run of this write leads use the scales stored with it."""
    if is_fp8(kv_pool):
        _write_fp8(kv_pool, layer, slot.tolist(), offset.tolist(), torch.stack([k, v], 1).float())
        return
    slot, offset = slot.long(), offset.long()
    kv_pool[slot, layer, 0, :, offset] = k.to(kv_pool.dtype)
    kv_pool[slot, layer, 1, :, offset] = v.to(kv_pool.dtype)


def _write_fp8(
    kv_pool: torch.Tensor, layer: int, slots: list[int], offsets: list[int], x: torch.Tensor
) -> None:
    """x [T, 2, Hkv, D] fp32 into an fp8 pool (`write_tokens`)."""
    c, n = chunk_tokens(kv_pool), len(slots)
    scales = fp8_scales(kv_pool)
    for t in range(n):
        if offsets[t]:
            continue
        r = 1
        while r < c and t + r < n and slots[t + r] == slots[t] and offsets[t + r] == r:
            r += 1
        scales[slots[t], layer] = fp8_scale(x[t : t + r].abs().amax(dim=(0, 3)), r == c)
    slot, offset = (torch.tensor(v, device=kv_pool.device) for v in (slots, offsets))
    q = quantize_fp8(x, scales[slot, layer][..., None])  # [T, 2, Hkv, D]
    kv_pool[slot, layer, 0, :, offset] = q[:, 0]
    fp8_v_tokens(kv_pool[:, layer, 1, :, :-1])[slot, :, offset] = q[:, 1]


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (RMSNorm(x + residual) * weight, x + residual), both in x's dtype. The sum is
    rounded to x's dtype before it is normalised, as the residual stream is kept in it."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype), x


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D] with cos/sin [T, D] fp32 (rope.apply_rotary)."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up [T, I] in the input's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
