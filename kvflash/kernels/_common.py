"""Launch-time facts the Triton wrappers share: device size, dot precision, pool strides."""

from __future__ import annotations

import functools

import torch

LOG2E = 1.4426950408889634
"""Attention kernels keep scores in base 2: exp2 is the instruction the hardware has."""
CPU_PROGRAMS = 4
"""Pretend SM count under the CPU interpreter: small, so that tests still see several splits."""


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_PROGRAMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def f32_dot(t: torch.Tensor) -> bool:
    """Off CUDA the kernels run in the interpreter, which keeps bf16 as raw uint16 and so cannot
    multiply it: there every tile is widened to fp32 before any arithmetic."""
    return t.device.type != "cuda"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (not TF32) so an fp32 pool matches its twin closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pool_strides(kv_pool: torch.Tensor, layer: int) -> tuple[int, int, int, int, int]:
    """(layer offset, slot, K->V, kv-head, token) element strides; the head_dim stride must be 1."""
    s = kv_pool.stride()
    assert s[5] == 1, "the pool's head_dim must be contiguous"
    return layer * s[1], s[0], s[2], s[3], s[4]


def pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn."""
FP8_HEADROOM = 32.0
"""A chunk whose first write holds fewer than all its tokens (a decode step, the last partial chunk
of a prompt) takes the scale of those tokens' largest magnitude times this, so that the tokens after
them fit; later tokens beyond 448 x scale are clamped. A write of the whole chunk takes its exact
maximum. e4m3 keeps 3 mantissa bits from 2^-6 to 448, so headroom costs precision only below
2^-6 x scale (docs/BENCHMARKS.md: "fp8 KV")."""


def is_fp8(kv: torch.Tensor) -> bool:
    return kv.dtype == FP8


def chunk_tokens(kv: torch.Tensor) -> int:
    """Tokens per chunk of a pool, host block or chunk `[..., rows, D]` (fp8: the last row holds
    scales)."""
    return kv.shape[-2] - is_fp8(kv)


def fp8_v_tokens(rows: torch.Tensor) -> torch.Tensor:
    """The token rows `[..., C, D]` of fp8 V blocks as held (each block's first C rows, without its
    scale row) seen in token order: a view `[..., C, D]`, through which values are read and written.

    A V block holds its C x D bytes channel-major, token t of channel d at byte d * C + t, so that a
    tile of V is K-major for a dot that takes V as its first operand; K blocks hold theirs token-major.
    The rows must be viewable as `[..., D, C]` (each block's C rows contiguous), as every block is."""
    *lead, c, d = rows.shape
    return rows.view(*lead, d, c).transpose(-1, -2)


def fp8_scales(kv: torch.Tensor) -> torch.Tensor:
    """The fp32 scales `[..., L, 2, Hkv]` of an fp8 pool, host block or chunk `[..., L, 2, Hkv, C + 1, D]`:
    a view of the first 4 bytes of each block's last row (kvflash/engine/pool.py: `slot_shape`)."""
    return kv[..., -1, :4].view(torch.float32)[..., 0]
