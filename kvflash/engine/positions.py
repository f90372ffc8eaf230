"""Positions within the cache: the rotations that move chunks' keys as if evicted chunks were absent.

Pool, host tier and disk keep every key at its absolute position. Under `cache_positions` a step
attends over its resident chunks as if they sat next to each other (StreamingLLM's cache positions),
in the document's order or by score (`ResidencyConfig.cache_order`), and selection scores each
earlier chunk from where it would sit if selected. Both are a rotation:
[n, 2, D/2] fp32, the cos and sin of each chunk's shift (in positions) times RoPE's inverse
frequencies, which the kernels apply to the chunk's keys (`kernels.reference.shift_keys`). None
stands for no shift at all, and the kernels then run unchanged.
"""

from __future__ import annotations

import functools

import torch

from kvflash import kernels
from kvflash.config import ModelConfig, ResidencyConfig
from kvflash.engine.to_device import on_device
from kvflash.models.rope import inv_frequencies


class CachePositions:
    """The rotations of one sequence's chunks, for its model and residency configuration."""

    def __init__(self, model: ModelConfig, cfg: ResidencyConfig, device: torch.device):
        self.cfg = cfg
        self._inv_freq = _inv_frequencies(model, device)

    def listed(self, order: list[int], first: int, scores: list[float]) -> torch.Tensor | None:
        """[len(order), 2, D/2]: each listed chunk (`order`, ascending, holding `first`, the step's
        first chunk; `scores`, theirs) moves forward to its place in the cache (`layout`), so that
        the evicted chunks take no positions; the step's own chunks are the last, contiguous places,
        so they stay put. None when no chunk moves, or cache positions are off."""
        if not self.cfg.cache_positions:
            return None
        c = self.cfg.chunk_tokens
        place = {i: p for p, i in enumerate(self.layout(order, first, scores))}
        gap_q = first - place[first]
        shift = [(gap_q - (i - place[i])) * c for i in order]
        if not any(shift):
            return None
        return self._rotation(on_device(shift, torch.long, self._inv_freq.device))

    def layout(self, order: list[int], first: int, scores: list[float]) -> list[int]:
        """The listed chunks in the order they sit in the cache. `document`: as listed. `score`: the
        chunks before the tail by score, ascending (ties by index), the sinks among them, then the
        tail and the step's own chunks: the best-scoring chunk sits just before the tail, where
        `candidates` scored it. A sink keeps no place of its own, since the document's first chunk
        is where a fact the question needs may stand too, and at the cache's first place it would
        stand a whole pool away from the question. With no chunk evicted every chunk keeps its own
        position, and the step computes what full attention computes."""
        if self.cfg.cache_order == "document" or len(order) == order[-1] + 1:
            return order
        hi = max(0, first - self.cfg.tail_chunks)
        before = sorted((s, i) for i, s in zip(order, scores, strict=True) if i < hi)
        return [*(i for _, i in before), *(i for i in order if i >= hi)]

    def candidates(self, first: int) -> torch.Tensor | None:
        """[first, 2, D/2]: scores each earlier chunk where it would be attended from if selected:
        just before the tail, `tail_chunks + 1` chunks before the step (nearer chunks stay). Scored at
        their absolute distance, far chunks lose to near ones by RoPE's decay alone, though selected
        they would sit near. None when cache positions are off or there is no earlier chunk."""
        if not self.cfg.cache_positions or not first:
            return None
        c, dev = self.cfg.chunk_tokens, self._inv_freq.device
        near = first - self.cfg.tail_chunks - 1
        return self._rotation((near - torch.arange(first, device=dev)).clamp(min=0) * c)

    def _rotation(self, shift: torch.Tensor) -> torch.Tensor:
        """[n, 2, D/2] cos and sin of each chunk's RoPE angles for a shift of `shift[i]` positions."""
        ang = shift.float()[:, None] * self._inv_freq
        return torch.stack([ang.cos(), ang.sin()], 1)


@functools.cache
def _inv_frequencies(model: ModelConfig, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies on `device`, once a model: every sequence reads the same (read only)
    tensor instead of computing and copying its own."""
    return inv_frequencies(model).to(device)


def rotate(keys: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
    """Keys or block means [n, L, Hkv, X, D] of n chunks rotated by rot [n, 2, D/2] (None: as they are)."""
    if rot is None:
        return keys
    return kernels.reference.shift_keys(keys.float().movedim(0, 2), rot).movedim(2, 0)
