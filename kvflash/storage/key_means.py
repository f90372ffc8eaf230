"""A chunk file's key summary, kept as its difference from the block means of the chunk's own keys.

The summary is the engine's mean key of each of B equal runs of a chunk's tokens
(`kernels.chunk_summaries`). A reader that has decoded the keys computes those means again, in a
fixed order (fp32, token after token, then divided by the run length: for 16-bit KV on a CPU the
engine's own result), so the difference carries bits only where the engine's arithmetic went another
way (fp32 KV, another device): a summary that took 4·L·Hkv·B·D bytes takes a few. The
difference is taken on the bit patterns, so any summary, NaN included, comes back bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from kvflash.storage import codec


def key_means(kv: torch.Tensor, blocks: int, exact: bool = True) -> np.ndarray:
    """fp32 `[L, Hkv, blocks, D]`: each run's mean key, summed token after token (a fixed order, so
    every reader gets the same bits). Zeros where the KV is not `exact` (fp8 of wider KV): the reader
    would see other keys than the writer, so the residual is the summary itself."""
    if not exact:
        return np.zeros((kv.shape[0], kv.shape[2], blocks, kv.shape[4]), dtype=np.float32)
    keys = codec.key_values(kv)
    L, H, C, D = keys.shape
    runs = keys.reshape(L, H, blocks, C // blocks, D)
    with np.errstate(all="ignore"):  # inf and NaN keys sum as IEEE says; the difference keeps them
        # a reduction over an axis that is not the innermost adds its slices in order, one after
        # another (no pairwise summation): token after token, in one call
        total = runs.sum(axis=3, dtype=np.float32)
        total /= np.float32(C // blocks)
    return total


def residual(summary: np.ndarray, means: np.ndarray) -> np.ndarray:
    """The summary's fp32 bit patterns less the means', zigzagged (small either way: few bits) and
    split into byte planes, most significant first: mostly zeros, which zstd stores in a few bytes."""
    diff = (summary.astype("<f4").view(np.uint32) - means.view(np.uint32)).view(np.int32).reshape(-1)
    zigzag = ((diff << 1) ^ (diff >> 31)).view(np.uint32)
    return np.stack([(zigzag >> (8 * (3 - j))).astype(np.uint8) for j in range(4)]).reshape(-1)


def summary_of(planes: bytes | memoryview, means: np.ndarray) -> np.ndarray:
    """Inverse of `residual`: fp32 of means' shape."""
    p = np.frombuffer(planes, dtype=np.uint8).reshape(4, -1).astype(np.uint32)
    zigzag = (p[0] << 24) | (p[1] << 16) | (p[2] << 8) | p[3]
    diff = (zigzag >> 1) ^ (np.uint32(0) - (zigzag & 1))
    return (means.view(np.uint32).reshape(-1) + diff).view("<f4").reshape(means.shape)
