"""Disk snapshot store: compressed, content-addressed chunk files and a SQLite index (docs/FORMAT.md)."""

from kvflash.storage.chunk import ROOT_HASH, ChunkBlob, ChunkSummary, chain_hash, chain_hashes
from kvflash.storage.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMismatch,
    ChunkMissing,
    ChunkUnavailable,
    DiskFull,
    ForeignFingerprint,
    InvalidChunk,
    InvalidName,
    SizeMismatch,
    SnapshotNotFound,
    StoreError,
    UnsupportedVersion,
)
from kvflash.storage.maintenance import DiskUsage, PruneReport, VerifyReport
from kvflash.storage.records import Snapshot, SnapshotInfo
from kvflash.storage.store import SnapshotStore

__all__ = [
    "ROOT_HASH",
    "ChunkBlob",
    "ChunkCorrupt",
    "ChunkError",
    "ChunkMismatch",
    "ChunkMissing",
    "ChunkUnavailable",
    "ChunkSummary",
    "DiskFull",
    "DiskUsage",
    "ForeignFingerprint",
    "InvalidChunk",
    "InvalidName",
    "PruneReport",
    "SizeMismatch",
    "Snapshot",
    "SnapshotInfo",
    "SnapshotNotFound",
    "SnapshotStore",
    "StoreError",
    "UnsupportedVersion",
    "VerifyReport",
    "chain_hash",
    "chain_hashes",
]
