"""The records of a snapshot index, whichever holds them (SQLite: kvflash/storage/index.py; Redis:
kvflash/storage/redis_index.py): chunk and snapshot rows, and what a removal policy sees and decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvflash.storage.format import ChunkHeader


@dataclass(frozen=True)
class ChunkRow:
    hash: str
    fingerprint: str
    index: int
    parent_hash: str
    n_tokens: int
    codec: str
    stored_bytes: int
    """The chunk file's size."""
    raw_bytes: int
    """The uncompressed KV's size."""
    refcount: int = 0
    damaged: str | None = None
    created: float = 0.0
    last_used: float = 0.0

    @classmethod
    def of(cls, h: ChunkHeader) -> ChunkRow:
        """The row of a chunk file, from its (parsed, size-checked) header."""
        return cls(
            h.chain_hash, h.fingerprint, h.index, h.parent_hash, h.n_tokens,
            h.codec.name.lower(), h.file_len, h.kv_bytes,
        )  # fmt: skip


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    label: str
    fingerprint: str
    n_tokens: int
    n_chunks: int
    created: float
    last_used: float
    hits: int
    pinned: bool
    meta: dict
    stored_bytes: int
    """Bytes of its chunk files, shared chunks counted in full."""
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


@dataclass(frozen=True)
class Snapshot(SnapshotInfo):
    chunk_hashes: tuple[str, ...] = ()


@dataclass
class PruneInput:
    """What a prune policy sees, read inside the transaction that applies its decision."""

    snapshots: list[SnapshotInfo]
    members: dict[str, list[str]]
    """snapshot id -> its chunk hashes."""
    chunks: dict[str, ChunkRow]
    leased: set[str]


@dataclass
class PruneDecision:
    snapshots: list[str] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    """Chunks left unreferenced and unleased once those snapshots are gone."""
    gone_owners: list[str] = field(default_factory=list)
    """Lease owners found gone: their owner files are the caller's to remove."""
    freed_bytes: int = 0
    remaining_bytes: int = 0
    """Stored bytes of the chunks removed and of those left, by the rows the decision was made on."""

    def sized(self, rows: dict[str, ChunkRow], stored_bytes: int | None = None) -> PruneDecision:
        """This decision with its byte counts, from the rows it was made on (`PruneInput.chunks`);
        `stored_bytes`, the store's total, where those rows are not all of it."""
        self.freed_bytes = sum(rows[h].stored_bytes for h in self.chunks if h in rows)
        total = sum(r.stored_bytes for r in rows.values()) if stored_bytes is None else stored_bytes
        self.remaining_bytes = total - self.freed_bytes
        return self


BAD_META: dict = {}
"""What a snapshot's meta reads as when the index holds no JSON object there (`malformed` names it)."""


def parse_meta(text: object) -> dict:
    """A snapshot's meta as the index holds it (JSON text), else BAD_META."""
    try:
        meta = json.loads(text) if isinstance(text, str | bytes) else None
    except ValueError:
        return BAD_META
    return meta if isinstance(meta, dict) else BAD_META
