"""The KV of earlier turns, reused for a new prompt: a live sequence that the prompt extends, else the
longest chunk-aligned prefix in the disk store, else nothing (a cold prefill).

A session keeps its one conversation live between turns; the server keeps as many as it runs at
once, so a client that resends a conversation with one more question reuses it from the GPU, and any
other conversation it has seen (in this process or an earlier one) from disk.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable

from kvflash.engine import Engine
from kvflash.paged_kv import PagedKV
from kvflash.snapshots import KVSnapshots, StoredSummaries
from kvflash.storage import ChunkError
from kvflash.turn import TurnStats


class PrefixCache:
    """Sequences are taken for a turn and kept (idle, live) after it; at most `capacity` sequences,
    idle and busy together, hold pool slots, so with budgets of pool/capacity the pool never runs out."""

    def __init__(
        self,
        engine: Engine,
        snapshots: KVSnapshots | None,
        budget_tokens: int | None = None,
        lazy: bool | None = None,
        capacity: int = 1,
    ):
        self.engine, self.snapshots = engine, snapshots
        self.budget_tokens, self.lazy, self.capacity = budget_tokens, lazy, capacity
        self.idle: list[PagedKV] = []
        """Sequences kept live after their turn, oldest first."""
        self._made: dict[int, tuple[PagedKV, contextlib.ExitStack]] = {}
        """Every sequence this cache made and has not freed, with the leases on the stored chunks it
        came from (a lazy one reads them later)."""

    @property
    def latest(self) -> PagedKV | None:
        return self.idle[-1] if self.idle else None

    def take(
        self,
        ids: list[int],
        stats: TurnStats,
        on_restore: Callable[[int, int], None] | None = None,
        ahead: StoredSummaries | None = None,
    ) -> PagedKV:
        """A sequence holding the longest prefix of ids that is live or stored, leaving at least one
        token to prefill; it is the caller's until `keep` or `drop`. A damaged snapshot warns and
        gives an empty sequence (a cold prefill)."""
        for kv in reversed(self.idle):
            if len(kv.seq) < len(ids) and kv.seq.tokens == ids[: len(kv.seq)]:
                self.idle.remove(kv)
                stats.source, stats.restored_tokens = "memory", len(kv.seq)
                return kv
        while self.idle and len(self._made) >= self.capacity:
            self.drop(self.idle.pop(0))
        kv = self._new()
        if not self.snapshots:
            return kv
        c = self.engine.cfg.residency.chunk_tokens
        evicts = -(-len(ids) // c) > kv.budget
        fp, hashes = self.snapshots.lookup(ids, c, approximate=evicts)
        if not hashes:
            return kv
        lazy = len(hashes) > kv.budget if self.lazy is None else self.lazy
        t0 = time.perf_counter()
        try:
            r = self.snapshots.restore(kv, fp, hashes, lazy, self._made[id(kv)][1], on_restore, ahead=ahead)
        except ChunkError as e:
            warnings.warn(f"snapshot unusable ({e}); prefilling cold", stacklevel=2)
            self.drop(kv)
            return self._new()
        stats.restore_s = time.perf_counter() - t0
        stats.source = "lazy" if lazy else "disk"
        stats.restored_tokens = r.tokens
        return kv

    def keep(self, kv: PagedKV) -> None:
        """Keeps a sequence live after its turn, for a prompt that extends it."""
        self.idle.append(kv)

    def drop(self, kv: PagedKV) -> None:
        """Frees a sequence (its slots and leases)."""
        kv, leases = self._made.pop(id(kv))
        kv.free()
        leases.close()

    def close(self) -> None:
        """Frees every sequence this cache made, idle or not."""
        for kv, _ in list(self._made.values()):
            self.drop(kv)
        self.idle.clear()

    def _new(self) -> PagedKV:
        kv = self.engine.new_sequence(self.budget_tokens)
        self._made[id(kv)] = kv, contextlib.ExitStack()
        return kv
