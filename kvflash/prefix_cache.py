"""The KV of earlier turns, reused for a new prompt: the live sequence when the prompt extends it, else
the longest chunk-aligned prefix in the disk store, else nothing (a cold prefill).

A session keeps one for its conversation; the server keeps one for whichever conversation it served
last, so a client that resends a conversation with one more question reuses it from the GPU, and any
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
    def __init__(
        self,
        engine: Engine,
        snapshots: KVSnapshots | None,
        budget_tokens: int | None = None,
        lazy: bool | None = None,
    ):
        self.engine, self.snapshots = engine, snapshots
        self.budget_tokens, self.lazy = budget_tokens, lazy
        self.kv: PagedKV | None = None
        self._leases = contextlib.ExitStack()
        """Leases on the stored chunks the live sequence came from (a lazy one reads them later)."""

    def close(self) -> None:
        """Frees the live sequence and releases its leases."""
        if self.kv is not None:
            self.kv.free()
            self.kv = None
        self._leases.close()

    def sequence_for(
        self,
        ids: list[int],
        stats: TurnStats,
        on_restore: Callable[[int, int], None] | None = None,
        ahead: StoredSummaries | None = None,
    ) -> PagedKV:
        """A sequence holding the longest prefix of ids that is live or stored, leaving at least one
        token to prefill. A damaged snapshot warns and gives an empty sequence (a cold prefill)."""
        kv = self.kv
        if kv is not None and len(kv.seq) < len(ids) and kv.seq.tokens == ids[: len(kv.seq)]:
            stats.source, stats.restored_tokens = "memory", len(kv.seq)
            return kv
        self.close()
        self.kv = kv = self.engine.new_sequence(self.budget_tokens)
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
            r = self.snapshots.restore(kv, fp, hashes, lazy, self._leases, on_restore, ahead=ahead)
        except ChunkError as e:
            warnings.warn(f"snapshot unusable ({e}); prefilling cold", stacklevel=2)
            self.close()
            self.kv = self.engine.new_sequence(self.budget_tokens)
            return self.kv
        stats.restore_s = time.perf_counter() - t0
        stats.source = "lazy" if lazy else "disk"
        stats.restored_tokens = r.tokens
        return kv
