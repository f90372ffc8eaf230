"""Moving one sequence's chunks between the tiers: the GPU pool, the host tier and the store.

A chunk's KV is in a pool slot (resident), a host-tier slot, or only in the store (a lazy restore:
`fetch` reads it into the host tier when it is selected or prefetched). Named chunks (sealed, exact
KV, by chain hash) take a reference to a slot another sequence holds instead of a copy, in either
tier. Every copy is counted in `moved`, by tier.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import torch

from kvflash import kernels
from kvflash.engine.host_tier import BLOCK_SLOTS, HostTier
from kvflash.engine.pool import ChunkPool, summary_shape
from kvflash.engine.sequence import Chunk
from kvflash.engine.to_device import on_device

Fetch = Callable[[list[str], list[torch.Tensor]], None]
"""Reads stored chunks (by chain hash) into host-tier slot views, in parallel."""
_versions = itertools.count(1)
"""Versions of every pager: one never repeats, whichever threads move chunks at once."""


class Pager:
    """One sequence's chunk moves and the slots it holds in the pool and the host tier."""

    def __init__(self, pool: ChunkPool, host: HostTier):
        self.pool, self.host = pool, host
        self.fetch: Fetch | None = None
        """Reads a lazy restore's chunks into host-tier slots (`PagedKV.adopt`); None once freed."""
        self.lock = threading.Lock()
        """Held while chunks are fetched: a truncation or a free waits for the batch in flight."""
        self.chunk_nbytes = pool.kv[0].numel() * pool.kv.element_size()
        self.moved = {"disk": 0, "host_to_gpu": 0, "gpu_to_host": 0}
        """Bytes of chunk KV moved per tier since the sequence began (for stats lines)."""
        self.evicted = 0
        """Chunks sent out of the pool since the sequence began."""
        self.version = 0
        """Changes (`touch`) after any of the sequence's chunks gains or loses a slot: what the
        sequence holds is computed again only then (admission's `HeldCache`)."""

    def touch(self) -> None:
        self.version = next(_versions)

    def evict(self, chunks: list[Chunk]) -> None:
        """Sends chunks to the host tier (those without a host copy yet) in one batch, and frees
        their pool slots: a page-in issued after it on the side stream may reuse them."""
        for ch in chunks:
            assert ch.sealed, f"chunk {ch.index} is not sealed and cannot leave the GPU"
        out = [ch for ch in chunks if ch.host is None and not self._share_host(ch)]
        for ch, h in zip(out, self.host.page_out_many([ch.gpu for ch in out]), strict=True):
            ch.host = h
            if ch.key is not None:
                self.host.publish(ch.key, h)
        self.moved["gpu_to_host"] += len(out) * self.chunk_nbytes
        self.evicted += len(chunks)
        for ch in chunks:
            self.pool.release(ch.gpu)
            ch.gpu = None
        self.touch()

    def load_to_host(self, chunks: list[Chunk]) -> None:
        """Brings disk-only chunks into the host tier in one parallel read (selection and prefetch)."""
        with self.lock:
            fetch = self.fetch  # `PagedKV.free` may clear it without the lock
            todo = [ch for ch in chunks if ch.host is None and ch.gpu is None and ch.disk is not None]
            todo = [ch for ch in todo if not self._share_host(ch)]
            if not todo or fetch is None:
                return
            slots = self.host.alloc_many(len(todo))
            try:
                fetch([ch.disk for ch in todo], [self.host.view(h) for h in slots])
            except BaseException:
                for h in slots:
                    self.host.release(h)
                raise
            for ch, h in zip(todo, slots, strict=True):
                ch.host = h
                if ch.key is not None:
                    self.host.publish(ch.key, h)
            self.touch()
            self.moved["disk"] += len(todo) * self.chunk_nbytes

    def chunk_kv(self, ch: Chunk) -> torch.Tensor:
        """A sealed chunk's KV `[L, 2, Hkv, C, D]` wherever it lives; a disk-only chunk is read first."""
        if ch.gpu is None and ch.host is None:
            self.load_to_host([ch])
        return self.pool.kv[ch.gpu] if ch.gpu is not None else self.host.view(ch.host)

    def _share_host(self, ch: Chunk) -> bool:
        """Takes a reference to the host copy of a named chunk where the host tier holds one."""
        if ch.key is not None:
            ch.host = self.host.share(ch.key)
            self.touch()
        return ch.host is not None

    def make_resident(self, chunks: list[Chunk]) -> None:
        """Gives chunks pool slots: a named chunk that some sequence holds in the pool shares its
        slot; the others get new slots, paging in those with host copies in one batch."""
        new = []
        for ch in chunks:
            g = None if ch.key is None else self.pool.index.find(ch.key)
            if g is None:
                new.append(ch)
            else:
                self.pool.share(g)
                ch.gpu = g
        for ch, g in zip(new, self.pool.alloc_many(len(new)), strict=True):
            ch.gpu = g
            if ch.key is not None:
                self.pool.index.add(ch.key, g)
        self.touch()
        paged = [ch for ch in new if ch.host is not None]
        self.host.page_in_many([ch.host for ch in paged], [ch.gpu for ch in paged])
        self.moved["host_to_gpu"] += len(paged) * self.chunk_nbytes

    def page(self, out: list[Chunk], wanted: list[Chunk]) -> None:
        """A selection's moves: `out` to the host tier (their pool slots freed for the page-ins), then
        every chunk of `wanted` into the pool, from the host tier or the store; returns once the
        copies have landed."""
        self.evict(out)
        self.load_to_host(wanted)
        self.make_resident([ch for ch in wanted if ch.gpu is None])
        self.host.fence()

    def take_shared(self, chunks: list[Chunk], keys: list[str]) -> None:
        """Gives each chunk a reference to the slot another sequence holds under its key: the pool
        slot where the chunk is resident, else its host copy. The chunks are sealed and named."""
        for ch, key in zip(chunks, keys, strict=True):
            g = self.pool.index.find(key)
            if g is not None:
                self.pool.share(g)
                ch.gpu = g
            else:
                ch.host = self.host.share(key)
            ch.key, ch.sealed = key, True
        self.touch()

    def summaries(self, chunks: list[Chunk], blocks: int) -> torch.Tensor:
        """[n, *summary_shape] of sealed chunks from their keys: in place in the pool, host copies
        staged to the pool's device a block at a time. Queued behind the steps running, never
        waiting for them: rows are placed by device indices (a list index is a blocking copy) and
        host copies are read without a wait (the sequence's references keep their slots)."""
        dev, i32 = self.pool.kv.device, torch.int32
        out = torch.empty((len(chunks), *summary_shape(self.pool.cfg, blocks)), device=dev)
        on_gpu = [i for i, ch in enumerate(chunks) if ch.gpu is not None]
        if on_gpu:
            slots = on_device([chunks[i].gpu for i in on_gpu], i32, dev)
            out.index_copy_(
                0, on_device(on_gpu, torch.long, dev), kernels.chunk_summaries(self.pool.kv, slots, blocks)
            )
        on_host = [i for i, ch in enumerate(chunks) if ch.gpu is None]
        self.host.fence()  # a page-out still copying is read after it lands
        for lo in range(0, len(on_host), BLOCK_SLOTS):
            part = on_host[lo : lo + BLOCK_SLOTS]
            views = [self.host.view(chunks[i].host) for i in part]
            staged = torch.empty((len(part), *views[0].shape), dtype=views[0].dtype, device=dev)
            for row, view in zip(staged, views, strict=True):
                row.copy_(view, non_blocking=True)
            rows = torch.arange(len(part), device=dev, dtype=i32)
            out.index_copy_(
                0, on_device(part, torch.long, dev), kernels.chunk_summaries(staged, rows, blocks)
            )
        return out

    def release(self, chunks: list[Chunk]) -> None:
        """Drops the chunks' references to their pool and host-tier slots."""
        for ch in chunks:
            if ch.gpu is not None:
                self.pool.release(ch.gpu)
                ch.gpu = None
            if ch.host is not None:
                self.host.release(ch.host)
                ch.host = None
        self.touch()
