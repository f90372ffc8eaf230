"""`StoreContext`: what the parts of one store share (its reads, writes and maintenance)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvflash.storage.backend import ChunkBackend
from kvflash.storage.locking import Coordination
from kvflash.storage.threads import Threads

if TYPE_CHECKING:
    from kvflash.storage.index import Index
    from kvflash.storage.redis_index import RedisIndex


@dataclass(frozen=True)
class StoreContext:
    backend: ChunkBackend
    """Where chunk and summaries files live."""
    index: Index | RedisIndex
    """The rows that name them: chunks, snapshots, leases."""
    threads: Threads
    """Saves and restores run on these."""
    coordination: Coordination
    where: str
    """The store, as messages name it."""
    read_only: bool
