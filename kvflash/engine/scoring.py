"""Chunk scoring for `qk` residency: the attention mass a step's queries would give each earlier chunk.

A scoring step records each layer's last `score_queries` queries; `end` scores the candidates (the
chunks before the step) from them, and the next selection keeps the chunks that score highest. A
prefill step scores from the chunks' summaries (block mean keys, `estimated`); the question's scouts
and decode re-selection score from the keys themselves (`exact`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import torch

from kvflash import kernels
from kvflash.config import ResidencyConfig
from kvflash.engine.host_tier import BLOCK_SLOTS, HostTier
from kvflash.engine.pool import ChunkPool
from kvflash.engine.positions import rotate
from kvflash.engine.sequence import Chunk
from kvflash.engine.to_device import on_device

SCORE_BYTES = 64 << 20
"""Logits memory one batch of chunk scoring (exact, or the summaries' estimate) may take."""

_in_place_refused: list[Exception] = []
"""Set when the Triton launcher refused a pinned host block's address (`ChunkScorer._host_lse`)."""


class ChunkScorer:
    """Scores one sequence's candidates wherever their KV lives; adds the bytes it reads from the
    host tier to `moved` (the sequence's counters)."""

    def __init__(
        self, pool: ChunkPool, host: HostTier, cfg: ResidencyConfig, uses_triton: bool, moved: dict[str, int]
    ):
        self.pool, self.host, self.cfg, self.uses_triton, self.moved = pool, host, cfg, uses_triton, moved
        self.chunk_nbytes = pool.kv[0].numel() * pool.kv.element_size()

    def estimated(self, qs: torch.Tensor, summaries: torch.Tensor, rot: torch.Tensor | None) -> torch.Tensor:
        """[N]: the attention mass each chunk would get, estimated from its summaries [N, L, Hkv, B, D]
        rotated by rot, for the queries qs [L, t, Hq, D] (prefill steps).

        Each block mean key stands in for its tokens; a softmax over all blocks of all candidate
        chunks gives every (query token, head) a distribution, and a chunk scores the largest share
        any of them gives it, summed over layers. Summed shares would favour chunks that everyone
        looks at a little; the max finds the chunk one retrieval head looks at a lot
        (docs/ARCHITECTURE.md, Residency). The layers' recorded queries are scored together, as many
        layers a batch as SCORE_BYTES of logits allow: a few launches a step instead of ~20 a layer.
        """
        scores = torch.zeros(summaries.shape[0], device=qs.device)
        for _, _, lse in self._estimates(qs, summaries, rot):
            scores += mass(lse).sum(0)
        return scores

    def exact(
        self,
        qs: torch.Tensor,
        chunks: list[Chunk],
        summaries: torch.Tensor | None,
        rot: torch.Tensor | None,
        from_host: bool,
    ) -> torch.Tensor:
        """[N]: scores of the N candidate `chunks` from their keys, for the queries qs [L, t, Hq, D];
        `summaries` (the sequence's, by chunk index) stand in for chunks whose keys are not read.

        A block mean key underrates a block holding one sharply matching key (exp is convex), which is
        what a needle looks like, so the question's scouts score from exact keys: chunks on the GPU
        and in the host tier read where they are (`from_host`, `_host_lse`), disk-only chunks (a
        lazy restore) at their summaries' estimate. Decode re-selection reads only the GPU.
        """
        n_layers, t, hq, _ = qs.shape
        dev, i32 = qs.device, torch.int32
        lse = torch.empty(n_layers, t, hq, len(chunks), device=dev)
        on_gpu = [ch for ch in chunks if ch.gpu is not None]
        on_host = [ch for ch in chunks if ch.gpu is None and ch.host is not None] if from_host else []
        rest = [ch.index for ch in chunks if ch.gpu is None and not (from_host and ch.host is not None)]
        # The twin holds a batch's logits in fp32; the kernel reads keys in place and holds none.
        twin = max(1, SCORE_BYTES // (n_layers * t * hq * self.cfg.chunk_tokens * 4))
        gpu_batch = max(1, len(on_gpu)) if self.uses_triton else twin
        for lo in range(0, len(on_gpu), gpu_batch):
            part = on_gpu[lo : lo + gpu_batch]
            slots = on_device([ch.gpu for ch in part], i32, dev)
            idx = on_device([ch.index for ch in part], torch.long, dev)
            lse[..., idx] = kernels.chunk_lse(qs, self.pool.kv, slots, _rows(rot, idx))
        for b, part in _by_block(on_host, BLOCK_SLOTS if self.uses_triton else twin):
            slots = on_device([ch.host % BLOCK_SLOTS for ch in part], i32, dev)
            idx = on_device([ch.index for ch in part], torch.long, dev)
            lse[..., idx] = self._host_lse(qs, self.host.block(b), slots, _rows(rot, idx))
        if rest:
            summ = summaries[on_device(rest, torch.long, dev)]
            for lo, hi, part in self._estimates(qs, summ, _rows(rot, rest)):
                lse[lo:hi, ..., rest] = part
        return mass(lse).mean(0)

    def _estimates(
        self, qs: torch.Tensor, summ: torch.Tensor, rot: torch.Tensor | None
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(lo, hi, log-masses [hi - lo, t, Hq, N]) for layers lo..hi-1: `_estimate_lse` of the
        queries qs [L, t, Hq, D] over summaries [N, L, Hkv, B, D] rotated by rot, as many layers at a
        time as SCORE_BYTES of logits allow."""
        n_layers, t, hq, _ = qs.shape
        step = max(1, SCORE_BYTES // (t * hq * summ.shape[0] * summ.shape[3] * 4))
        for lo in range(0, n_layers, step):
            hi = min(lo + step, n_layers)
            yield lo, hi, self._estimate_lse(qs[lo:hi], rotate(summ[:, lo:hi], rot))

    def _estimate_lse(self, qs: torch.Tensor, summ: torch.Tensor) -> torch.Tensor:
        """log Σ exp(q·k/√d) over each chunk's tokens, with every block's tokens at its mean key.

        qs [L', t, Hq, D], summaries [N, L', Hkv, B, D] of the same layers -> [L', t, Hq, N]."""
        n, _, h_kv, blocks, d = summ.shape
        qs = qs.view(*qs.shape[:2], h_kv, -1, d)
        logits = torch.einsum("lthgd,nlhbd->lthgnb", qs, summ) * d**-0.5
        return (logits.logsumexp(-1) + math.log(self.cfg.chunk_tokens // blocks)).flatten(2, 3)

    def _host_lse(
        self, qs: torch.Tensor, block: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None
    ) -> torch.Tensor:
        """`kernels.chunk_lse` over chunks of a host-tier block: where the Triton kernels run they
        read the keys in place over the bus (pinned memory is addressable from the GPU), the keys
        alone and once; elsewhere the block's chunks are copied to the queries' device first."""
        n = slots.numel()
        if block.device == qs.device:  # on the CPU the host tier is the queries' own memory
            return kernels.chunk_lse(qs, block, slots, rot)
        if self.uses_triton and block.is_pinned() and not _in_place_refused:
            try:
                out = kernels.chunk_lse_in_place(qs, block, slots, rot)
            except ValueError as e:  # Triton could not address the block: stage it, and say so once
                _in_place_refused.append(e)
                warnings.warn(f"host-tier chunks are staged to score them: {e}", stacklevel=2)
            else:
                self.moved["host_to_gpu"] += n * self.chunk_nbytes // 2
                return out
        block = block[slots.cpu().long()].to(qs.device)
        slots = torch.arange(n, device=qs.device, dtype=torch.int32)
        self.moved["host_to_gpu"] += n * self.chunk_nbytes
        return kernels.chunk_lse(qs, block, slots, rot)


def mass(lse: torch.Tensor) -> torch.Tensor:
    """[L, t, Hq, N] chunk log-masses -> [L, N]: the largest softmax share any query and head gives
    each chunk, per layer."""
    return torch.softmax(lse, dim=-1).flatten(1, 2).amax(1)


def _rows(rot: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if rot is None else rot[index]


def _by_block(chunks: list[Chunk], batch: int) -> Iterator[tuple[int, list[Chunk]]]:
    """Host-tier chunks grouped by the block holding them, at most `batch` a group."""
    blocks: dict[int, list[Chunk]] = {}
    for ch in chunks:
        blocks.setdefault(ch.host // BLOCK_SLOTS, []).append(ch)
    for b, part in blocks.items():
        for lo in range(0, len(part), batch):
            yield b, part[lo : lo + batch]
