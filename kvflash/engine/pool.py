"""The GPU chunk pool: one tensor of slots, one slot per chunk, so a page-in or out is one copy.

Slots are counted references: a sealed chunk of exact KV is named by its chain hash (`index`) and
read by every sequence whose prompt shares its prefix; a sequence that evicts or drops it releases
its own reference, and the slot is free once the last reader has released it. A sealed chunk is
never written again, so a shared slot is read-only."""

from __future__ import annotations

import math
import os

import torch

from kvflash import KVFlashError
from kvflash.config import ModelConfig
from kvflash.engine.chunk_index import ChunkIndex
from kvflash.engine.decode_staging import StagingCache


class PoolFull(KVFlashError):
    pass


FP8 = torch.float8_e4m3fn


def chunk_shape(cfg: ModelConfig, chunk_tokens: int) -> tuple[int, ...]:
    """Per-chunk KV `[n_layers, 2, n_kv_heads, chunk_tokens, head_dim]`, as stored and hashed."""
    return (cfg.n_layers, 2, cfg.n_kv_heads, chunk_tokens, cfg.head_dim)


def slot_shape(cfg: ModelConfig, chunk_tokens: int, dtype: torch.dtype) -> tuple[int, ...]:
    """A slot's layout, shared by the pool and the host tier: `chunk_shape`, with one more row per
    (layer, K/V, kv-head) for fp8 KV, whose first 4 bytes hold that block's fp32 scale
    (`kernels.fp8_scales`). So a chunk's scales travel with its bytes: a page-out, a page-in or a
    staging copy of an fp8 chunk is still one copy of one contiguous run. An fp8 V block's C rows
    hold its bytes channel-major, a K block's token-major (`kernels._common.fp8_v_tokens`)."""
    rows = chunk_tokens + (dtype == FP8)
    return (cfg.n_layers, 2, cfg.n_kv_heads, rows, cfg.head_dim)


def summary_shape(cfg: ModelConfig, summary_blocks: int) -> tuple[int, ...]:
    """Per-chunk key summary `[n_layers, n_kv_heads, summary_blocks, head_dim]` (block mean keys)."""
    return (cfg.n_layers, cfg.n_kv_heads, summary_blocks, cfg.head_dim)


def chunk_bytes(cfg: ModelConfig, chunk_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of one slot (`slot_shape`)."""
    return math.prod(slot_shape(cfg, chunk_tokens, dtype)) * dtype.itemsize


def slots_for(
    cfg: ModelConfig,
    budget_tokens: int | str,
    chunk_tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    reserve_bytes: int = 2 << 30,
    summary_blocks: int = 4,
) -> int:
    """Whole slots for a token budget, or `auto`: free device memory minus a reserve (on the CPU,
    half the free host memory minus the reserve: the host tier and the process need the rest). An
    `auto` slot counts its chunk's key summary too (fp32, on the device beside the pool for every
    chunk of a sequence): a pool that took all the memory would leave none for the summaries of the
    contexts it holds."""
    if budget_tokens == "auto":
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        summary = 4 * math.prod(summary_shape(cfg, summary_blocks))
        n = (free - reserve_bytes) // (chunk_bytes(cfg, chunk_tokens, dtype) + summary)
    else:
        n = -(-int(budget_tokens) // chunk_tokens)
    if n < 1:
        raise KVFlashError(f"pool budget {budget_tokens} leaves no chunk slot")
    return int(n)


class ChunkPool:
    """Slots of `slot_shape` (`[n_layers, 2, Hkv, C, D]`, C + 1 rows for fp8); the epoch changes
    whenever a slot starts or stops being read by several sequences, so that what a sequence holds
    and shares (admission's counts) is computed again instead of being trusted. A sequence's own
    slots coming and going are its pager's `version`.
    One more slot than `n_slots`, `pad_slot`, is never given out: the rows that pad a batched decode
    step to the size its CUDA graph was captured for write and read it."""

    def __init__(
        self, cfg: ModelConfig, n_slots: int, chunk_tokens: int, dtype: torch.dtype, device: torch.device
    ):
        self.cfg = cfg
        self.chunk_tokens = chunk_tokens
        self.kv = torch.zeros(
            (n_slots + 1, *slot_shape(cfg, chunk_tokens, dtype)), dtype=dtype, device=device
        )
        self._free = list(range(n_slots - 1, -1, -1))
        self._refs = [0] * n_slots
        """Readers of each slot (0: free): a release is checked in O(1), not by a scan of `_free`."""
        self.index = ChunkIndex()
        """The sealed chunks of exact KV in the pool, by chain hash."""
        self.n_shared = 0
        """Slots read by more than one sequence."""
        self.peak_used = 0
        """The most slots in use at once since `reset_peak`."""
        self.pad_slot = n_slots
        self.epoch = 0
        self.stagings = StagingCache(cfg.head_dim, device)
        """The decode buffers of its sequences' Triton steps, reused from freed sequences."""

    @property
    def n_slots(self) -> int:
        return self.pad_slot

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        """Slots holding a chunk, a shared one counted once."""
        return self.n_slots - len(self._free)

    def reset_peak(self) -> None:
        self.peak_used = self.n_used

    def refs(self, slot: int) -> int:
        return self._refs[slot]

    def alloc(self) -> int:
        return self.alloc_many(1)[0]

    def alloc_many(self, n: int) -> list[int]:
        """n free slots, ascending (so that a step's page-ins coalesce into runs where they can)."""
        if n > len(self._free):
            raise PoolFull(f"the chunk pool's {self.n_slots} slots are all in use")
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for slot in out:
            self._refs[slot] = 1
        self.peak_used = max(self.peak_used, self.n_used)
        return sorted(out)

    def share(self, slot: int) -> None:
        """One more reader of a slot in use (a sealed chunk another sequence holds)."""
        assert 0 <= slot < self.n_slots and self._refs[slot], f"bad share of slot {slot}"
        self._refs[slot] += 1
        if self._refs[slot] == 2:
            self.n_shared += 1
            self.epoch += 1

    def release(self, slot: int) -> None:
        """Drops one reader's reference; the last one frees the slot (and its name)."""
        assert 0 <= slot < self.n_slots and self._refs[slot], f"bad release of slot {slot}"
        self._refs[slot] -= 1
        if self._refs[slot] == 1:
            self.n_shared -= 1
            self.epoch += 1
        if self._refs[slot]:
            return
        self.index.forget(slot)
        self._free.append(slot)
