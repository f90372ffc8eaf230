"""Host tier: chunks evicted from the GPU pool, in pinned host memory with the pool's per-chunk layout.

Copies run on a side CUDA stream; the compute stream waits on it (a device-side wait, not a host sync)
only when a page-in was issued or a paged-out slot is about to be rewritten.
"""

from __future__ import annotations

import threading

import torch

from kvflash import KVFlashError
from kvflash.pool import ChunkPool, chunk_bytes, chunk_shape

BLOCK_SLOTS = 64
"""Host memory grows in blocks of this many chunks, so a large budget costs nothing until used."""


class HostTierFull(KVFlashError):
    pass


class HostTier:
    def __init__(self, pool: ChunkPool, budget_bytes: int):
        self.pool = pool
        self.shape = chunk_shape(pool.cfg, pool.chunk_tokens)
        self.dtype = pool.kv.dtype
        self.max_slots = budget_bytes // chunk_bytes(pool.cfg, pool.chunk_tokens, self.dtype)
        self.cuda = pool.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.kv.device) if self.cuda else None
        self._blocks: list[torch.Tensor] = []
        self._free: list[int] = []
        self._pending_in = False
        self._pending_out = False
        self._lock = threading.Lock()  # a restore's prefetch thread allocates too

    @property
    def n_used(self) -> int:
        return len(self._blocks) * BLOCK_SLOTS - len(self._free)

    def _grow(self) -> None:
        start = len(self._blocks) * BLOCK_SLOTS
        n = min(BLOCK_SLOTS, self.max_slots - start)
        if n <= 0:
            raise HostTierFull(f"the host tier is full ({self.max_slots} chunks); raise --host-bytes")
        block = torch.empty((BLOCK_SLOTS, *self.shape), dtype=self.dtype, pin_memory=self.cuda)
        self._blocks.append(block)
        self._free.extend(range(start + n - 1, start - 1, -1))

    def view(self, host_slot: int) -> torch.Tensor:
        return self._blocks[host_slot // BLOCK_SLOTS][host_slot % BLOCK_SLOTS]

    def alloc(self) -> int:
        with self._lock:
            if not self._free:
                self._grow()
            return self._free.pop()

    def release(self, host_slot: int) -> None:
        with self._lock:
            self._free.append(host_slot)

    def page_out(self, gpu_slot: int) -> int:
        """Copies a pool slot into a new host slot (async on CUDA); returns the host slot."""
        h = self.alloc()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.pool.kv.device))
            with torch.cuda.stream(self.stream):
                self.view(h).copy_(self.pool.kv[gpu_slot], non_blocking=True)
            self._pending_out = True
        else:
            self.view(h).copy_(self.pool.kv[gpu_slot])
        return h

    def page_in(self, host_slot: int, gpu_slot: int) -> None:
        if self.cuda:
            with torch.cuda.stream(self.stream):
                self.pool.kv[gpu_slot].copy_(self.view(host_slot), non_blocking=True)
            self._pending_in = True
        else:
            self.pool.kv[gpu_slot].copy_(self.view(host_slot))

    def fence(self) -> None:
        """Makes the compute stream wait for issued copies before it reads or rewrites their slots."""
        if self.cuda and (self._pending_in or self._pending_out):
            torch.cuda.current_stream(self.pool.kv.device).wait_stream(self.stream)
        self._pending_in = self._pending_out = False
