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
