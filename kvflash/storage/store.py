"""`SnapshotStore`: chunk files content-addressed by chain hash, snapshots as ordered lists of them.

Ordering rules that keep the invariants (docs/DESIGN.md: Disk store):
- a chunk file is durable before the index row that names it is committed;
- rows are deleted (and committed) before their files are unlinked, under the exclusive store lock,
  which saves hold shared from their existence checks to their commit;
- chunks leased by a restore in flight and pinned snapshots are never removed.

Each snapshot's chain also has a summaries file (kvflash/storage/summaries.py): its chunks' token
ids and key summaries in one file, which a lazy restore reads instead of one section of every chunk
file. It is written with the chunk files, before the index commit, and swept with the orphans once
no snapshot has its chain. It only ever spares reads: a snapshot without one (written before
summaries files, or whose file is damaged) restores through its chunk files, and `verify` writes it
again.

Damage to the store never stops an answer: a damaged index is set aside and rebuilt from the chunk
files (kvflash/storage/rebuild.py), a read-only store opens read-only (listing, verifying and
restoring work; saving says why it cannot), bookkeeping a restore can do without (its hit, damage
marks) is best effort, and a removal on a full disk frees the store's reserve file to make room for
its own index transaction.

`SnapshotStore` is what callers use. It keeps the snapshots' rows and a restore's lookup, lease and
hit itself, and hands the rest to its parts, which state their own rules: `reader`
(kvflash/storage/chunk_reader.py), `summary_reader` (kvflash/storage/summary_reader.py), `writer`
(kvflash/storage/snapshot_writer.py) and `maintenance` (kvflash/storage/maintenance.py).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
import warnings
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvflash.storage.backend import ChunkBackend
from kvflash.storage.chunk import ChunkBlob, ChunkSummary
from kvflash.storage.chunk_reader import ChunkReader
from kvflash.storage.codec import DEFAULT_LEVEL
from kvflash.storage.context import StoreContext
from kvflash.storage.errors import ChunkMissing, ChunkUnavailable, StoreError
from kvflash.storage.format import ChunkHeader
from kvflash.storage.index import Index
from kvflash.storage.index_db import IndexDamaged
from kvflash.storage.local_backend import LocalDirBackend
from kvflash.storage.locking import LEASE_TTL_S, Coordination, Heartbeat, LocalCoordination, StoreLock
from kvflash.storage.maintenance import DiskUsage, Maintenance, PruneReport, VerifyReport
from kvflash.storage.names import check_hash, check_snapshot_id
from kvflash.storage.rebuild import rebuild_index
from kvflash.storage.records import Snapshot, SnapshotInfo
from kvflash.storage.snapshot_writer import SnapshotWriter, check_codec
from kvflash.storage.summary_reader import SummaryReader
from kvflash.storage.threads import Threads
from kvflash.storage.workers import StoreWorkers

if TYPE_CHECKING:
    from kvflash.storage.redis_index import RedisIndex

MAX_DEFAULT_WORKERS = 8
"""A decode thread holds the GIL for 12-17% of its CPU time (perf, 2-core VM), so 8 threads come near
one GIL's worth and 16 are over it: 16 threads restore no faster than 8 (docs/BENCHMARKS.md:
Snapshot store)."""


class SnapshotStore:
    """One per process (an SQLite connection does not survive fork); safe across threads."""

    def __init__(
        self,
        root: Path | str,
        codec: str = "lossless",
        level: int = DEFAULT_LEVEL,
        workers: int | None = None,
        backend: ChunkBackend | None = None,
        processes: int = 0,
        save_threads: int | None = None,
    ):
        """`workers` threads save and restore; with `processes` > 0 (a local directory only), saves
        encode and batch restores decode in that many worker processes instead
        (kvflash/storage/workers.py: threads stop scaling at ~8 on the GIL, and hold the GIL the
        caller's other threads need). `workers.default_processes()` picks by the core count.
        `save_threads`: chunks a save encodes at once (all the workers where None); a server that
        saves in the background beside its scheduler takes fewer (`tiered.SERVER_SAVE_THREADS`)."""
        check_codec(codec, level)
        self.root = Path(root)
        self.where = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            backend = backend or LocalDirBackend(self.root)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as a snapshot store: {e.strerror or e}") from None
        read_only = not os.access(self.root, os.W_OK)
        coordination = LocalCoordination(self.root, read_only)
        path = self.root / "index.sqlite"
        index = coordination.with_reserve(partial(_open_index, path, read_only, coordination.lock, backend))
        if not read_only:
            coordination.make_reserve()
        procs = None
        if processes > 0 and isinstance(backend, LocalDirBackend):
            procs = StoreWorkers(str(self.root), processes)
        self._assemble(backend, index, coordination, read_only, codec, level, workers, procs, save_threads)

    def _assemble(
        self,
        backend: ChunkBackend,
        index: Index | RedisIndex,
        coordination: Coordination,
        read_only: bool,
        codec: str,
        level: int,
        workers: int | None,
        processes: StoreWorkers | None = None,
        save_threads: int | None = None,
    ) -> None:
        """What every store has, whatever holds its chunks and index."""
        self.backend, self.index, self.coordination, self.read_only = backend, index, coordination, read_only
        self.threads = Threads(workers or min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1), "kvflash-store")
        ctx = StoreContext(backend, index, self.threads, coordination, self.where, read_only)
        self.processes = processes
        """Worker processes that encode saves and decode restores, if any (`processes` > 0)."""
        self.reader = ChunkReader(ctx, processes)
        self.summary_reader = SummaryReader(ctx, self.reader)
        self.writer = SnapshotWriter(ctx, self.summary_reader, codec, level, processes, save_threads)
        self.maintenance = Maintenance(ctx, self.reader, self.summary_reader, self.writer)

    def close(self) -> None:
        self.threads.shutdown()
        self.reader.close()
        if self.processes is not None:
            self.processes.close()
        self.index.close()
        self.coordination.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # snapshots

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self.index.snapshot(check_snapshot_id(snapshot_id))

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self.index.snapshots()

    def pin(self, snapshot_id: str) -> None:
        self.index.set_pinned(check_snapshot_id(snapshot_id), True)

    def unpin(self, snapshot_id: str) -> None:
        self.index.set_pinned(check_snapshot_id(snapshot_id), False)

    # restore bookkeeping

    def find_longest_prefix(self, fingerprint: str, chain_hashes: Sequence[str]) -> int:
        """How many leading chunks of a chain are stored intact under this fingerprint."""
        intact = self.index.intact([check_hash(h) for h in chain_hashes], fingerprint)
        n = 0
        for h in chain_hashes:
            if h not in intact:
                break
            n += 1
        for i, there in enumerate(self.backend.exists_all(chain_hashes[:n])):
            if not there:  # deleted (or evicted) behind the index: the next save rewrites it
                self.reader.set_damaged(chain_hashes[i], "file missing")
                return i
        return n

    @contextmanager
    def lease(self, hashes: Sequence[str]) -> Iterator[None]:
        """Marks chunks as in use by a restore, across processes, until the block exits. Raises
        ChunkMissing up front if any is no longer stored, ChunkUnavailable if the lease cannot be
        written (a full disk, an index another process holds): the restore then falls back to
        prefill. A read-only store needs no lease: nothing can remove its chunks.

        The rule a removal keeps (docs/FORMAT.md: Leases): a lease lives while this store object
        holds its owner lock, so a stalled heartbeat never frees what a reader still needs."""
        hashes = [check_hash(h) for h in hashes]
        if self.read_only:
            yield
            return
        lease_id = secrets.token_hex(8)
        try:
            self.index.add_lease(lease_id, self.coordination.lease_owner(), hashes, time.time())
        except ChunkMissing:
            raise
        except (StoreError, sqlite3.Error) as e:
            raise ChunkUnavailable(hashes[0] if hashes else "-", f"cannot lease: {e}") from None
        try:
            with Heartbeat(lambda: self.index.heartbeat(lease_id, time.time()), LEASE_TTL_S / 4):
                yield
        finally:
            try:
                self.index.drop_lease(lease_id)
            except (StoreError, sqlite3.Error):
                pass  # the owner lock goes with this store object: a removal then reaps the row

    def record_hit(self, hashes: Sequence[str]) -> None:
        """Called when a restore commits: counts a hit and promotes the chunks and snapshots in LRU."""
        if hashes and not self.read_only:
            try:
                self.index.record_hit([check_hash(h) for h in hashes], time.time())
            except (StoreError, sqlite3.Error) as e:
                warnings.warn(f"the restore was not counted in the store's hits: {e}", stacklevel=2)

    # what its parts do

    def put_snapshot(
        self,
        label: str,
        fingerprint: str,
        chunks: Iterable[ChunkBlob | str],
        meta: dict | None = None,
        succeeds: Sequence[str] = (),
        known: Sequence[ChunkSummary] = (),
    ) -> str:
        return self.writer.put_snapshot(label, fingerprint, chunks, meta, succeeds, known)

    def yield_saves_to(self, quiet: threading.Event, max_wait_s: float) -> None:
        self.writer.yield_to(quiet, max_wait_s)

    def copy_in(
        self,
        files: Iterable[tuple[str, bytes]],
        snapshot: Snapshot | None = None,
        succeeds: Sequence[str] = (),
        summaries: bytes | bytearray | None = None,
    ) -> None:
        self.writer.copy_in(files, snapshot, succeeds, summaries)

    def read_chunk(
        self,
        chunk_hash: str,
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
        with_summary: bool = True,
    ) -> ChunkBlob:
        return self.reader.read_chunk(
            chunk_hash, expect_fingerprint, expect_shape, expect_dtype, out, with_summary
        )

    def read_chunks_parallel(
        self,
        hashes: Sequence[str],
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: Sequence[torch.Tensor] | None = None,
        with_summary: bool = True,
    ) -> list[ChunkBlob]:
        return self.reader.read_chunks_parallel(
            hashes, expect_fingerprint, expect_shape, expect_dtype, out, with_summary
        )

    def chunk_file(self, chunk_hash: str) -> bytes:
        return self.reader.chunk_file(chunk_hash)

    def read_header(self, chunk_hash: str) -> ChunkHeader:
        return self.reader.read_header(chunk_hash)

    def read_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        return self.summary_reader.read_summaries(hashes, expect_fingerprint, out)

    def chain_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary] | None:
        return self.summary_reader.chain_summaries(hashes, expect_fingerprint, out)

    def chunk_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        return self.summary_reader.chunk_summaries(hashes, expect_fingerprint, out)

    def has_summaries(self, fp: str, hashes: Sequence[str]) -> bool:
        return self.summary_reader.has_summaries(fp, hashes)

    def summaries_file(self, fp: str, hashes: Sequence[str]) -> bytearray:
        return self.summary_reader.summaries_file(fp, hashes)

    def rm(self, snapshot_id: str) -> PruneReport:
        return self.maintenance.rm(snapshot_id)

    def prune(
        self,
        max_bytes: int | None = None,
        older_than: float | None = None,
        dry_run: bool = False,
        keep: Collection[str] = (),
    ) -> PruneReport:
        return self.maintenance.prune(max_bytes, older_than, dry_run, keep)

    def verify(self, snapshot_id: str | None = None) -> VerifyReport:
        return self.maintenance.verify(snapshot_id)

    def du(self) -> DiskUsage:
        return self.maintenance.du()


def _open_index(path: Path, read_only: bool, lock: StoreLock, backend: ChunkBackend) -> Index:
    """The index. One that is damaged, or missing where chunk files are stored (a rebuild that
    ended between setting a damaged index aside and putting the new one in its place), is rebuilt
    from the chunk files, under the exclusive lock so that one process rebuilds while the others
    wait for it."""
    try:
        if read_only or path.exists() or not _holds_chunks(backend):
            return Index(path, read_only)
        damage = f"index {path} is missing beside stored chunk files"
    except IndexDamaged as e:
        if read_only:
            raise StoreError(f"{e}; the store is read-only, so it cannot be rebuilt") from None
        damage = str(e)
    with lock.exclusive():
        try:
            if path.exists():
                return Index(path)  # another process may have rebuilt it meanwhile
        except IndexDamaged:
            pass
        aside, n = rebuild_index(path, backend)
    kept = f"set aside as {aside.name} and " if aside else ""
    warnings.warn(f"{damage}; {kept}rebuilt from {n} chunk files", stacklevel=3)
    return Index(path)


def _holds_chunks(backend: ChunkBackend) -> bool:
    return next(iter(backend.list_files()), None) is not None
