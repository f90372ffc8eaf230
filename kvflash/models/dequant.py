"""GGML tensor types dequantised with torch ops on the target device.

The raw blocks go to the device as bytes (a quarter to an eighth of the bf16 weights for 4-bit
types) and are expanded there, a slice of blocks at a time so the fp32 intermediates stay small.
Each type mirrors ggml's reference layout, computing in fp32 with the same operations in the same
order as the `gguf` package's numpy code, so the fp32 result is bit-equal to it; a narrower output
dtype is that result rounded once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvflash import KVFlashError

QK_K = 256
SLICE_ELEMENTS = 1 << 24
"""Elements dequantised per step: bounds the fp32 temporaries (a few times 64 MiB)."""


@dataclass(frozen=True)
class GGMLType:
    name: str
    block_size: int
    """Elements per block."""
    type_size: int
    """Bytes per block."""
    blocks: Callable[[torch.Tensor], torch.Tensor]
    """[n, type_size] uint8 -> [n, block_size] fp32."""
    scales: tuple[int, int] = (0, 0)
    """Bytes of the block's fp16 scale (and min): the only bytes that must be finite."""

    def nbytes(self, n_elements: int) -> int:
        return n_elements // self.block_size * self.type_size


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2k] bytes -> [n, k] fp32 from little-endian fp16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, g, m] bytes -> [n, g, 2m]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., m] bytes -> [..., count, m]: field i of `width` bits of each byte, i = 0..count-1."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << width) - 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:].unsqueeze(1)).view(b.shape[0], 32)
    return d * (q.to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:].unsqueeze(1)).view(b.shape[0], 32).float()
    return d * q + m


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32]: bit i, the 5th bit of element i."""
    return _bits(qh, 1, 8).transpose(1, 2).reshape(qh.shape[0], 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    ql = _nibbles(b[:, 6:].unsqueeze(1)).view(b.shape[0], 32)
    q = (ql | (_q5_high(b[:, 2:6]) << 4)).to(torch.int8) - 16
    return d * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    ql = _nibbles(b[:, 8:].unsqueeze(1)).view(b.shape[0], 32)
    q = (ql | (_q5_high(b[:, 4:8]) << 4)).float()
    return d * q + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per block."""
    s = scales.view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min over the 8 sub-blocks of 32 of a Q4_K/Q5_K block."""
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).view(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).view(n, 8, 1)
    return (d * q.view(n, 8, 32).float() - dm).view(n, QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:].reshape(-1, 4, 32)))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32)).view(n, 8, 32)
    qh = _bits(b[:, 16:48], 1, 8)  # [n, 8, 32]: bit j of qh[l] is the 5th bit of sub-block j
    return _k_affine(b, ql | (qh << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql = _nibbles(b[:, :128].reshape(n, 2, 64)).view(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), 2, 4).view(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    return (d * q.view(n, 16, 16).float()).view(n, QK_K)


def _float(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda b: b.contiguous().view(dtype).float()


TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4, _float(torch.float32)),
    1: GGMLType("F16", 1, 2, _float(torch.float16)),
    30: GGMLType("BF16", 1, 2, _float(torch.bfloat16)),
    2: GGMLType("Q4_0", 32, 18, _q4_0, (0, 2)),
    3: GGMLType("Q4_1", 32, 20, _q4_1, (0, 4)),
    6: GGMLType("Q5_0", 32, 22, _q5_0, (0, 2)),
    7: GGMLType("Q5_1", 32, 24, _q5_1, (0, 4)),
    8: GGMLType("Q8_0", 32, 34, _q8_0, (0, 2)),
    12: GGMLType("Q4_K", QK_K, 144, _q4_k, (0, 4)),
    13: GGMLType("Q5_K", QK_K, 176, _q5_k, (0, 4)),
    14: GGMLType("Q6_K", QK_K, 210, _q6_k, (208, 210)),
}
"""GGML type id (as stored in GGUF tensor infos) -> its layout and dequantiser."""


def random_blocks(kind: GGMLType, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, type_size] uint8 of valid blocks: random bytes, finite small fp16 scales (and
    finite values for the float types). Stands in for a quantiser where the `gguf` package has none
    (the k-quants), for tests and benchmarks."""
    if kind.block_size == 1:
        dtype = {"F32": np.float32, "F16": np.float16}.get(kind.name)
        values = rng.standard_normal(n_blocks).astype(np.float32)
        if dtype is None:  # BF16: the high half of each fp32
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
        return values.astype(dtype).view(np.uint8).reshape(n_blocks, kind.type_size)
    out = rng.integers(0, 256, (n_blocks, kind.type_size), dtype=np.uint8)
    start, stop = kind.scales
    scales = (rng.standard_normal((n_blocks, (stop - start) // 2)) * 0.01).astype(np.float16)
    out[:, start:stop] = scales.view(np.uint8)
    return out


def ggml_type(type_id: int, what: str) -> GGMLType:
    """The supported type of that id, else a one-line error naming the type (and `what` has it)."""
    if type_id in TYPES:
        return TYPES[type_id]
    try:
        from gguf import GGMLQuantizationType

        name = GGMLQuantizationType(type_id).name
    except ValueError:
        name = f"unknown type {type_id}"
    supported = ", ".join(t.name for t in TYPES.values())
    raise KVFlashError(f"{what} is {name}, which kvflash cannot dequantize (supported: {supported})")


def dequantize(
    raw: torch.Tensor, kind: GGMLType, n_elements: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Flat [n_elements] tensor of `dtype` on `device` from the tensor's raw bytes (uint8, any device)."""
    if n_elements % kind.block_size:
        raise KVFlashError(f"{n_elements} elements are not whole {kind.name} blocks of {kind.block_size}")
    blocks = raw.view(-1, kind.type_size)
    out = torch.empty(n_elements, dtype=dtype, device=device)
    step = max(1, SLICE_ELEMENTS // kind.block_size)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step].to(device)
        values = kind.blocks(part).view(-1)
        out[start * kind.block_size : start * kind.block_size + values.numel()] = values
    return out
