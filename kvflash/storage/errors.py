"""Error classes of the disk store: each failure a caller may handle differently has its own class."""

from __future__ import annotations

from kvflash import KVFlashError


class StoreError(KVFlashError):
    """Any failure of the snapshot store."""


class InvalidName(StoreError):
    """A snapshot id, label, chunk hash or fingerprint that the store refuses (it could escape the store
    directory, or it is not text the store can keep)."""


class InvalidChunk(StoreError):
    """A chunk handed to `put_snapshot` that is not full, final and chained to its predecessor."""


class SnapshotNotFound(StoreError):
    pass


class ChunkError(StoreError):
    """A stored chunk that cannot be served; a restore falls back to a cold prefill."""

    def __init__(self, chunk_hash: str, reason: str):
        super().__init__(f"chunk {chunk_hash[:16]}: {reason}")
        self.chunk_hash = chunk_hash
        self.reason = reason


class ChunkMissing(ChunkError):
    pass


class ChunkCorrupt(ChunkError):
    """Checksums, magic, truncation or a header whose sizes disagree with the file or the shape."""


class SizeMismatch(ChunkCorrupt):
    """A header whose lengths disagree with the file size or the shape: refused before allocating."""


class ChunkUnavailable(ChunkError):
    """A chunk the store cannot serve now, though nothing shows it damaged: a read the system refused,
    or a lease it could not record (a full disk, a read-only or locked index). Not marked damaged."""


class ChunkMismatch(ChunkError):
    """An intact chunk whose shape or dtype is not the one the caller expects."""


class UnsupportedVersion(ChunkError):
    pass


class ForeignFingerprint(ChunkError):
    """KV made under another model fingerprint: never restored."""


class DiskFull(StoreError):
    pass
