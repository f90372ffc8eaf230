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
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import sqlite3
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from kvflash.storage.backend import ChunkBackend, LocalDirBackend, ReadBuffer
from kvflash.storage.chunk import ROOT_HASH, ChunkBlob, ChunkSummary, token_bytes
from kvflash.storage.codec import CODEC_NAMES, DEFAULT_LEVEL
from kvflash.storage.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkUnavailable,
    DiskFull,
    ForeignFingerprint,
    InvalidChunk,
    StoreError,
)
from kvflash.storage.format import (
    HEADER_SIZE,
    MAX_FILE_BYTES,
    ChunkHeader,
    check_file,
    check_identity,
    decode_chunk,
    decode_meta,
    encode_chunk,
    parse_header,
)
from kvflash.storage.index import (
    LEASE_TTL_S,
    ChunkRow,
    Index,
    IndexDamaged,
    PruneDecision,
    PruneInput,
    Snapshot,
    SnapshotInfo,
)
from kvflash.storage.locking import Heartbeat, LeaseOwner, StoreLock, owner_alive
from kvflash.storage.names import check_fingerprint, check_hash, check_label, check_snapshot_id, is_hash
from kvflash.storage.rebuild import rebuild, set_aside
from kvflash.storage.summaries import (
    NATIVE,
    SUMMARIES_HEADER_SIZE,
    HeadRead,
    check_summaries_file,
    entry_crc,
    pack_head,
    parse_summaries_header,
)
from kvflash.storage.summaries import check_identity as check_summaries_identity
from kvflash.storage.workers import DecodeWorkers, WorkerFailed

T = TypeVar("T")
MAX_META_BYTES = 1 << 20
MAX_DEFAULT_WORKERS = 8
"""A decode thread holds the GIL for 12-17% of its CPU time (perf, 2-core VM), so 8 threads come near
one GIL's worth and 16 are over it: 16 threads restore no faster than 8 (docs/BENCHMARKS.md:
Snapshot store)."""
RESERVE_BYTES = 1 << 20
"""`<root>/reserve`: space held back so that a removal on a full disk can write its index
transaction (a WAL of a few hundred pages for thousands of chunks) and so free the rest."""
SUMMARIES_TRIES = 3
"""Summaries files a read tries (of the snapshots through its prefix, shortest chain first) before
it reads per chunk: each miss costs a read, and a store written before summaries files has none."""


@dataclass(frozen=True)
class Damage:
    chunk_hash: str
    reason: str
    snapshots: tuple[str, ...]


@dataclass
class VerifyReport:
    checked_snapshots: int
    checked_chunks: int
    damaged: list[Damage] = field(default_factory=list)
    index_errors: list[str] = field(default_factory=list)
    orphan_files: int = 0
    """Chunk and temp files no index row names (a save killed mid-write), summaries files of no
    snapshot's chain: harmless, prune removes them."""
    orphan_bytes: int = 0
    summaries: list[Damage] = field(default_factory=list)
    """Summaries files missing, damaged or not of their chain (`chunk_hash`: the chain's last hash).
    Nothing is lost (restores read those summaries per chunk file), so they do not count against
    `ok`; on a writable store each is written again from the chunk files."""

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.index_errors


@dataclass
class PruneReport:
    dry_run: bool
    snapshots: list[str]
    chunks: int
    freed_bytes: int
    remaining_bytes: int
    swept_files: int
    """Orphan chunk files, summaries files of no snapshot's chain (those of the snapshots removed
    among them) and temp files of interrupted saves removed (0 on a dry run)."""


@dataclass
class DiskUsage:
    root: str
    snapshots: int
    pinned: int
    chunks: int
    stored_bytes: int
    raw_bytes: int
    unreferenced_bytes: int
    damaged_chunks: int
    index_bytes: int
    orphan_files: int
    """Files under chunks/ that no index row names, summaries files of no snapshot's chain (prune
    removes them)."""
    orphan_bytes: int
    summaries_files: int
    """Summaries files of the snapshots' chains (not in `stored_bytes`, which counts chunk files)."""
    summaries_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


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
    ):
        """`workers` threads save and restore; with `processes` > 0 (a local directory only), batch
        restores decode in that many worker processes instead (kvflash/storage/workers.py: threads
        stop scaling at ~8 on the GIL). `workers.default_processes()` picks by the core count."""
        _check_codec(codec, level)
        self.root = Path(root)
        self.where = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.backend = backend or LocalDirBackend(self.root)
        except OSError as e:
            raise StoreError(f"cannot use {self.root} as a snapshot store: {e.strerror or e}") from None
        self.read_only = not os.access(self.root, os.W_OK)
        self.lock = StoreLock(self.root / "lock", self.read_only)
        self._owner = LeaseOwner(self.root / "owners")
        self.index = self._with_reserve(self._open_index)
        if not self.read_only:
            _make_reserve(self.root / "reserve")
        self._start(codec, level, workers)
        if processes > 0 and isinstance(self.backend, LocalDirBackend):
            self.decoders = DecodeWorkers(str(self.root), processes)
            self._drivers = ThreadPoolExecutor(processes, thread_name_prefix="kvflash-drive")

    def _start(self, codec: str, level: int, workers: int | None) -> None:
        """What every store has, whatever holds its chunks and index."""
        self.codec = CODEC_NAMES[codec]
        self.level = level
        self.workers = workers or min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kvflash-store")
        self._hints = ThreadPoolExecutor(1, thread_name_prefix="kvflash-hint")
        self._local = threading.local()
        self._meta_len_hint = 0
        self.decoders: DecodeWorkers | None = None
        self.fetched: Callable[[str, int], None] | None = None
        """Sees the hash and size of every chunk read and verified (a tier in front copies them to
        itself)."""

    # what a store on a local directory does its own way (kvflash/storage/redis_store.py does it
    # otherwise)

    def _saving(self) -> AbstractContextManager:
        """Held by a save from its "is this chunk stored?" checks to its index commit."""
        return self.lock.shared()

    def _removing(self) -> AbstractContextManager:
        """Held by a removal: no save is then between writing a chunk and indexing it."""
        return self.lock.exclusive()

    def _lease_owner(self) -> str:
        return self._owner.hold()

    def _owner_alive(self, token: str) -> bool | None:
        return owner_alive(self.root / "owners", token)

    def _after_removal(self, decision: PruneDecision) -> None:
        for token in decision.gone_owners:
            (self.root / "owners" / token).unlink(missing_ok=True)
        _make_reserve(self.root / "reserve")

    def _index_bytes(self) -> int:
        files = [self.root / f"index.sqlite{s}" for s in ("", "-wal", "-shm")]
        return sum(f.stat().st_size for f in files if f.exists())

    def close(self) -> None:
        self.pool.shutdown()
        self._hints.shutdown(cancel_futures=True)
        if self.decoders is not None:
            self._drivers.shutdown()
            self.decoders.close()
        self.index.close()
        self._owner.release()

    def _open_index(self) -> Index:
        """The index; one that is not a database is set aside and rebuilt from the chunk files,
        under the exclusive lock so that one process rebuilds while the others wait for it."""
        path = self.root / "index.sqlite"
        try:
            return Index(path, self.read_only)
        except IndexDamaged as e:
            if self.read_only:
                raise StoreError(f"{e}; the store is read-only, so it cannot be rebuilt") from None
            damage = e
        with self.lock.exclusive():
            try:
                return Index(path)  # another process may have rebuilt it meanwhile
            except IndexDamaged:
                pass
            aside = set_aside(path)
            index = Index(path)
            n = rebuild(index, self.backend)
        warnings.warn(f"{damage}; set aside as {aside.name} and rebuilt from {n} chunk files", stacklevel=3)
        return index

    def _with_reserve(self, fn: Callable[[], T]) -> T:
        """fn(), and on a full disk fn() again once the reserve file is gone."""
        try:
            return fn()
        except DiskFull:
            reserve = self.root / "reserve"
            if not reserve.is_file():
                raise
            reserve.unlink()
            return fn()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # saving

    def put_snapshot(
        self,
        label: str,
        fingerprint: str,
        chunks: Iterable[ChunkBlob | str],
        meta: dict | None = None,
        succeeds: Sequence[str] = (),
        known: Sequence[ChunkSummary] = (),
    ) -> str:
        """Saves chunks 0..n-1 of a sequence as a new snapshot and returns its id. It starts with the
        hits of the snapshots it `succeeds` (ids; the caller removes them). `known`: summaries of the
        chain's first chunks as `read_summaries` gave them (checked then), which the snapshot's
        summaries file takes instead of reading them again.

        Only chunks not already stored are encoded and written (in parallel). An item may be a chain
        hash instead of a blob for a chunk the caller knows is stored (`find_longest_prefix`), so a
        grown prefix is re-snapshotted without gathering its KV. On any failure (disk full included)
        files this call wrote are removed and nothing stored before is touched."""
        check_label(label)
        check_fingerprint(fingerprint)
        succeeds = [check_snapshot_id(i) for i in succeeds]
        if self.read_only:
            raise StoreError(f"the snapshot store {self.where} is read-only: nothing saved")
        meta_json = _check_meta(meta or {})
        items = list(chunks)
        written: list[str] = []
        summaries: list[str] = []
        try:
            with self._saving():
                hashes, rows, n_tokens = self._write_chunks(fingerprint, items, written)
                self._save_summaries(fingerprint, items, hashes, written, summaries, known)
                now = time.time()
                return self.index.add_snapshot(
                    label, fingerprint, n_tokens, meta_json, hashes, rows, now, succeeds
                )
        except BaseException:
            if written or summaries:
                self._remove_unindexed(written, summaries)
            raise

    def _write_chunks(
        self, fingerprint: str, items: list[ChunkBlob | str], written: list[str]
    ) -> tuple[list[str], list[ChunkRow], int]:
        hashes: list[str] = []
        rows: list[ChunkRow] = []
        pending: deque[Future[ChunkRow]] = deque()
        chunk_tokens, layout = None, None
        # One index query and one existence check for the whole sequence, not one per chunk (2,048
        # of them at 128K tokens).
        named = [check_hash(x) if isinstance(x, str) else x.chain_hash for x in items]
        known = self.index.chunk_rows(named)
        indexed = [h for h in named if h in known]
        there = dict(zip(indexed, self.backend.exists_all(indexed), strict=True))
        try:
            for pos, item in enumerate(items):
                parent = hashes[-1] if hashes else ROOT_HASH
                if isinstance(item, str):
                    row = _stored_link(known.get(item), item, fingerprint, pos, parent)
                    if not there[item]:
                        raise ChunkMissing(item, "given by hash but its file is gone; pass the chunk itself")
                    h, c = row.hash, row.n_tokens
                else:
                    _check_link(item, fingerprint, pos, parent)
                    this = (tuple(item.kv.shape), item.kv.dtype, item.summary.shape[2])
                    layout = layout or this
                    if this != layout:
                        raise InvalidChunk(
                            f"chunk {pos}: shape, dtype or summary blocks differ from the chunks before"
                        )
                    h, c = item.chain_hash, len(item.tokens)
                    row = known.get(h)
                    if row is None or row.damaged or not there[h]:
                        written.append(h)
                        pending.append(self.pool.submit(self._store_one, item))
                        while len(pending) >= 2 * self.workers:
                            rows.append(pending.popleft().result())
                if c != (chunk_tokens := chunk_tokens or c):
                    raise InvalidChunk(f"chunk {pos}: {c} tokens, earlier chunks have {chunk_tokens}")
                hashes.append(h)
            while pending:
                rows.append(pending.popleft().result())
        finally:
            for f in pending:
                f.cancel()
            for f in pending:
                if not f.cancelled():
                    f.exception()
        if not hashes:
            raise InvalidChunk("nothing to save: a snapshot needs at least one full chunk")
        return hashes, rows, len(hashes) * chunk_tokens

    def _store_one(self, blob: ChunkBlob) -> ChunkRow:
        head, payload, h = encode_chunk(blob, self.codec, self.level)
        self.backend.put(blob.chain_hash, (head, payload))
        return ChunkRow.of(h)

    def _save_summaries(
        self,
        fp: str,
        items: list[ChunkBlob | str],
        hashes: list[str],
        written: list[str],
        out: list[str],
        known: Sequence[ChunkSummary] = (),
    ) -> None:
        """Writes the summaries file of a chain being saved, unless one of it is stored (appending
        its name to `out` first). A chunk this save wrote gives its own token ids and summary, a
        `known` one those read before, every other those its chunk file holds (read back, from the
        summaries file of a snapshot the chain extends where there is one): the file holds what the
        chunk files hold. Best effort, as the file only spares reads: without it the snapshot
        restores per chunk."""
        last = hashes[-1]
        try:
            if self.has_summaries(fp, hashes):
                return
            new = set(written)
            entries = {
                i: (x.tokens, x.summary)
                for i, x in enumerate(items)
                if isinstance(x, ChunkBlob) and x.chain_hash in new
            }
            for i, k in enumerate(known[: len(hashes)]):
                if i not in entries and k.chain_hash == hashes[i]:
                    entries[i] = (k.tokens, k.summary)
            old = [i for i in range(len(hashes)) if i not in entries]
            if old:
                read = self.read_summaries([hashes[i] for i in old], fp)
                entries.update((i, (s.tokens, s.summary)) for i, s in zip(old, read, strict=True))
            parts = self._summaries_parts(fp, last, [entries[i] for i in range(len(hashes))])
            out.append(last)
            self.backend.put_summaries(last, parts)
        except StoreError as e:
            warnings.warn(f"snapshot saved without its summaries file: {e}", stacklevel=3)

    def _summaries_parts(
        self, fp: str, last: str, entries: list[tuple[list[int], torch.Tensor]]
    ) -> list[bytes | memoryview]:
        """The summaries file of a chain ending at `last`, as parts to write; the entries' checksums
        are computed on the pool."""
        tokens = [token_bytes(t) for t, _ in entries]
        rows = [_f32_bytes(s) for _, s in entries]
        shape = tuple(entries[0][1].shape)
        if any(len(t) != len(tokens[0]) for t in tokens) or any(s.shape != shape for _, s in entries):
            raise InvalidChunk("the chain's chunks differ in length or summary shape")
        crcs = self._map(lambda i: entry_crc(tokens[i], rows[i]), len(entries))
        return [pack_head(fp, last, len(entries[0][0]), shape, crcs), *tokens, *rows]

    def has_summaries(self, fp: str, hashes: Sequence[str]) -> bool:
        """Whether a summaries file of exactly this chain is stored (by its header alone)."""
        last, n = check_hash(hashes[-1]), len(hashes)

        def plan(head: memoryview, size: int) -> list:
            h = parse_summaries_header(head, size, last)
            check_summaries_identity(h, last, fp, n)
            if h.n_chunks != n:
                raise ChunkCorrupt(last, f"{h.n_chunks} chunks for a chain of {n}")
            return []

        try:
            self.backend.get_summaries(last, SUMMARIES_HEADER_SIZE, plan)
        except ChunkError:
            return False
        return True

    def summaries_file(self, fp: str, hashes: Sequence[str]) -> bytearray:
        """The summaries file of a chain as stored, every check passed (all its entries, of exactly
        this chain): what `verify` checks and a copy to another store sends."""
        last = check_hash(hashes[-1])
        got: list[bytearray] = []

        def plan(head: memoryview, size: int) -> list[tuple[int, memoryview]]:
            parse_summaries_header(head, size, last)  # its sizes checked before the file is read
            got.append(bytearray(size))
            return [(0, memoryview(got[0]))]

        self.backend.get_summaries(last, SUMMARIES_HEADER_SIZE, plan)
        check_summaries_file(got[0], last, fp, hashes)
        return got[0]

    def chunk_file(self, chunk_hash: str) -> bytes:
        """A chunk's file as stored, its checksums and chain hash checked but its KV not decoded:
        what a copy to another store sends."""
        h = check_hash(chunk_hash)
        try:
            buf = self.backend.get(h, MAX_FILE_BYTES, None, HEADER_SIZE, _header_check(h))
            check_file(buf, h)
        except ChunkError as e:
            self._mark(e)
            raise
        return bytes(buf)

    def copy_in(
        self,
        files: Iterable[tuple[str, bytes]],
        snapshot: Snapshot | None = None,
        succeeds: Sequence[str] = (),
        summaries: bytes | bytearray | None = None,
    ) -> None:
        """Stores (hash, file) pairs copied from another store as they are, each checked first, and
        with `snapshot` that snapshot under its own id (starting with the hits of those it
        `succeeds` here) and its chain's summaries file if given: how the tiers of a TieredStore
        fill each other. Chunks without a snapshot are indexed unreferenced, so a prune may take
        them first."""
        if self.read_only:
            raise StoreError(f"the snapshot store {self.where} is read-only: nothing copied")
        rows: list[ChunkRow] = []
        written: list[str] = []
        try:
            with self._saving():
                for h, data in files:
                    rows.append(ChunkRow.of(check_file(data, check_hash(h))))
                    written.append(h)
                    self.backend.put(h, (data,))
                if snapshot is None:
                    self.index.add_chunk_rows(rows, time.time())
                    return
                s = snapshot
                meta = _check_meta(s.meta)
                hashes = list(s.chunk_hashes)
                if summaries is not None:
                    self._copy_summaries(s.fingerprint, hashes, summaries)
                self.index.add_snapshot(
                    s.label, s.fingerprint, s.n_tokens, meta, hashes, rows, s.created, succeeds, s.id
                )
        except BaseException:
            if written:
                self._remove_unindexed(written)
            raise

    def _copy_summaries(self, fp: str, hashes: list[str], data: bytes | bytearray) -> None:
        """A summaries file copied from another store, checked first; best effort, as a save's."""
        try:
            check_summaries_file(data, hashes[-1], fp, hashes)
            self.backend.put_summaries(hashes[-1], (data,))
        except StoreError as e:
            warnings.warn(f"snapshot copied without its summaries file: {e}", stacklevel=3)

    def _remove_unindexed(self, hashes: list[str], summaries: Sequence[str] = ()) -> None:
        """After a failed save: its chunk files that no index row names, its summaries file if no
        snapshot has that chain (none can be mid-save: exclusive)."""
        with self._removing():
            indexed = self.index.chunk_rows(hashes)
            for h in hashes:
                if h not in indexed:
                    self.backend.delete(h)
            ends = self.index.chain_ends() if summaries else set()
            for h in summaries:
                if h not in ends:
                    self.backend.delete_summaries(h)

    # reading

    def read_chunk(
        self,
        chunk_hash: str,
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> ChunkBlob:
        """One chunk, every checksum and the chain hash verified; ChunkError subclasses otherwise.
        `out` (a contiguous CPU tensor, e.g. a host-tier slot) receives the KV and sets the expected
        shape and dtype; it is written only after every check has passed."""
        outs = None if out is None else [out]
        return self.read_chunks_parallel([chunk_hash], expect_fingerprint, expect_shape, expect_dtype, outs)[
            0
        ]

    def read_chunks_parallel(
        self,
        hashes: Sequence[str],
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: Sequence[torch.Tensor] | None = None,
    ) -> list[ChunkBlob]:
        """Chunks in the given order (into `out[i]` where given); reads and decodes run on the pool."""
        outs = _check_out(out, len(hashes))
        self._check_rows(hashes, expect_fingerprint)
        if len(hashes) > 1:
            # On a thread of its own: once the disk's queue is full each hint blocks, and hinting a
            # thousand chunks before the first decode left the decoders idle for most of the read.
            self._hints.submit(self.backend.will_need, list(hashes))
        if self.decoders is not None and self.decoders.ready and len(hashes) > 1:
            shape = None if expect_shape is None else tuple(expect_shape)
            try:
                return self._read_in_processes(hashes, expect_fingerprint, shape, expect_dtype, outs)
            except WorkerFailed:
                pass  # the threads below read every chunk again, and report their own errors
        load = partial(
            self._load, fp=expect_fingerprint, shape=expect_shape, dtype=expect_dtype, stored_crc=False
        )
        return self._map(lambda i: load(hashes[i], outs[i]), len(hashes))

    def read_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        """Token ids and key summaries without the KV: from one summaries file where a snapshot's
        chain starts with `hashes` (`chain_summaries`), else from each chunk file's sections (a few
        percent of it; `chunk_summaries`). `out`, contiguous fp32 `[len(hashes), L, Hkv, B, D]` on
        the CPU, receives the summaries in order."""
        if out is not None:
            assert out.dtype == torch.float32 and out.device.type == "cpu" and len(out) == len(hashes)
            assert out.is_contiguous()
        self._check_rows(hashes, expect_fingerprint)
        got = self.chain_summaries(hashes, expect_fingerprint, out)
        return got if got is not None else self._chunk_summaries(hashes, expect_fingerprint, out)

    def chain_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary] | None:
        """`read_summaries` of chunks 0..n-1 of a chain from the summaries file of a snapshot whose
        chain starts with them (the index names it): one read, straight into `out`. None where no
        file serves (none stored, damaged, of another shape): the caller reads per chunk. The file
        is checked on its own (its checksums, and its token ids must give `hashes`), so a bad one
        marks nothing in the index."""
        if not hashes or not NATIVE:
            return None
        for last in self.index.chains_through(check_hash(hashes[-1]), len(hashes) - 1)[:SUMMARIES_TRIES]:
            try:
                return self._read_head(last, hashes, expect_fingerprint, out)
            except ChunkError:
                continue
        return None

    def _read_head(
        self, last: str, hashes: Sequence[str], fp: str, out: torch.Tensor | None
    ) -> list[ChunkSummary]:
        read = HeadRead(last, fp, hashes, out)
        self.backend.get_summaries(last, SUMMARIES_HEADER_SIZE, read.plan)
        tokens = read.check_tokens()
        n_runs = min(len(hashes), self.workers)
        bounds = [len(hashes) * i // n_runs for i in range(n_runs + 1)]
        self._map(lambda i: read.check_entries(bounds[i], bounds[i + 1]), n_runs)
        parents = [ROOT_HASH, *hashes[:-1]]
        return [ChunkSummary(i, h, parents[i], tokens[i], read.rows[i]) for i, h in enumerate(hashes)]

    def chunk_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        """`read_summaries` from each chunk file's token and summary sections. Header and
        token/summary checksums are verified here; the payload's when its chunk is read."""
        self._check_rows(hashes, expect_fingerprint)
        return self._chunk_summaries(hashes, expect_fingerprint, out)

    def _chunk_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None
    ) -> list[ChunkSummary]:
        def one(i: int) -> ChunkSummary:
            return self._load_summary(hashes[i], expect_fingerprint, None if out is None else out[i])

        return self._map(one, len(hashes))

    def _load_summary(self, h: str, fp: str, out: torch.Tensor | None = None) -> ChunkSummary:
        try:
            # One read for header and sections: the chunks of a sequence share one shape, so the
            # last chunk's section length predicts this one's (a second read covers a miss).
            buf, size = self.backend.get_range(h, 0, HEADER_SIZE + self._meta_len_hint)
            header = parse_header(buf, size, h)
            check_identity(header, h, fp)
            end = HEADER_SIZE + header.tokens_len + header.summary_len
            if len(buf) < end:
                more, _ = self.backend.get_range(h, len(buf), end - len(buf))
                buf += more
            self._meta_len_hint = end - HEADER_SIZE
            tokens, summary = decode_meta(header, memoryview(buf)[HEADER_SIZE:end], h, out)
        except ChunkError as e:
            self._mark(e)
            raise
        return ChunkSummary(header.index, h, header.parent_hash, tokens, summary)

    def _read_in_processes(
        self,
        hashes: Sequence[str],
        fp: str,
        shape: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        outs: list[torch.Tensor | None],
    ) -> list[ChunkBlob]:
        """Runs of consecutive chunks, a few per worker so a slow one does not hold up the end, each
        driven by a thread that waits on its worker and copies its output."""
        assert self.decoders is not None
        n_runs = min(len(hashes), 4 * self.decoders.n)
        bounds = [len(hashes) * i // n_runs for i in range(n_runs + 1)]

        def run(i: int) -> list[ChunkBlob]:
            lo, hi = bounds[i], bounds[i + 1]
            try:
                return self.decoders.read(hashes[lo:hi], fp, shape, dtype, outs[lo:hi])
            except ChunkError as e:
                self._mark(e)
                raise

        runs = self._map(run, n_runs, self._drivers, self.decoders.n)
        return [blob for blobs in runs for blob in blobs]

    def _map(
        self, fn: Callable[[int], T], n: int, pool: ThreadPoolExecutor | None = None, width: int = 0
    ) -> list[T]:
        """[fn(0), ..., fn(n - 1)] on the pool, as one task per thread that takes the next index
        whenever it finishes one. A future per chunk cost each chunk a wake-up of the waiting caller
        (Future.set_result notifies under the GIL) and a Future with its Condition: 40-55% of the
        GIL-holding samples of a restore. After a failure the tasks stop taking indices, and the
        failure of the lowest index is raised."""
        results: dict[int, T] = {}
        failures: list[tuple[int, BaseException]] = []
        indices = iter(range(n))  # next() on it is atomic under the GIL

        def run() -> None:
            for i in indices:
                if failures:
                    return
                try:
                    results[i] = fn(i)
                except BaseException as e:
                    failures.append((i, e))

        pool, width = pool or self.pool, width or self.workers
        for task in [pool.submit(run) for _ in range(min(width, n))]:
            task.result()
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        return [results[i] for i in range(n)]

    def read_header(self, chunk_hash: str) -> ChunkHeader:
        buf, size = self.backend.get_range(check_hash(chunk_hash), 0, HEADER_SIZE)
        return parse_header(buf, size, chunk_hash)

    def _check_rows(self, hashes: Sequence[str], fingerprint: str) -> None:
        """Every chunk indexed under the fingerprint and intact; the rows are read only to say which
        is not and why."""
        hashes = [check_hash(h) for h in hashes]
        if len(self.index.intact(hashes, fingerprint)) == len(set(hashes)):
            return
        rows = self.index.chunk_rows(hashes)
        for h in hashes:
            row = rows.get(h)
            if row is None:
                raise ChunkMissing(h, "not in the index")
            if row.fingerprint != fingerprint:
                raise ForeignFingerprint(h, f"made under {row.fingerprint}, expected {fingerprint}")
            if row.damaged:
                raise ChunkCorrupt(h, f"found damaged earlier: {row.damaged}")

    def _load(
        self,
        h: str,
        out: torch.Tensor | None = None,
        *,
        fp: str,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        stored_crc: bool = True,
    ) -> ChunkBlob:
        if not hasattr(self._local, "buffer"):
            self._local.buffer = ReadBuffer()
        try:
            buf = self.backend.get(h, MAX_FILE_BYTES, self._local.buffer, HEADER_SIZE, _header_check(h))
        except ChunkError as e:
            self._mark(e)
            raise
        blob = self._decode(buf, h, fp, shape, dtype, out, stored_crc)
        if self.fetched is not None:
            self.fetched(h, len(buf))
        return blob

    def _decode(
        self,
        buf: bytes | memoryview,
        h: str,
        fp: str,
        shape: Sequence[int] | None,
        dtype: torch.dtype | None,
        out: torch.Tensor | None,
        stored_crc: bool = True,
    ) -> ChunkBlob:
        """`stored_crc=False` on restores: see format.decode_chunk; `verify` checks every checksum."""
        try:
            return decode_chunk(buf, h, fp, shape, dtype, out, stored_crc)
        except ChunkError as e:
            # the index vouched for this fingerprint, so a foreign one in the file is damage too
            self._mark(e)
            raise

    def _mark(self, e: ChunkError) -> None:
        if isinstance(e, ChunkCorrupt | ChunkMissing | ForeignFingerprint):
            self._set_damaged(e.chunk_hash, e.reason)

    def _set_damaged(self, h: str, reason: str | None) -> None:
        """Best effort (a full disk, a busy or read-only index): the caller still gets the real error."""
        if self.read_only:
            return
        try:
            self.index.mark_damaged(h, reason)
        except (StoreError, sqlite3.Error):
            pass

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
                self._set_damaged(chain_hashes[i], "file missing")
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
            self.index.add_lease(lease_id, self._lease_owner(), hashes, time.time())
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

    # snapshots

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self.index.snapshot(check_snapshot_id(snapshot_id))

    def list_snapshots(self) -> list[SnapshotInfo]:
        return self.index.snapshots()

    def pin(self, snapshot_id: str) -> None:
        self.index.set_pinned(check_snapshot_id(snapshot_id), True)

    def unpin(self, snapshot_id: str) -> None:
        self.index.set_pinned(check_snapshot_id(snapshot_id), False)

    def rm(self, snapshot_id: str) -> PruneReport:
        """Removes one snapshot and the chunks only it held (those leased stay until released)."""
        self.get_snapshot(snapshot_id)
        return self._remove(partial(_plan_rm, snapshot_id=snapshot_id), dry_run=False)

    def prune(
        self, max_bytes: int | None = None, older_than: float | None = None, dry_run: bool = False
    ) -> PruneReport:
        """Least recently used snapshots first, until stored bytes fit max_bytes; also every snapshot
        unused for older_than seconds. Pinned snapshots and leased chunks stay. Always collects
        unreferenced chunks, orphan files and temp files of interrupted saves."""
        cutoff = time.time() - older_than if older_than is not None else None
        return self._remove(partial(_plan_prune, max_bytes=max_bytes, cutoff=cutoff), dry_run)

    def _remove(self, decide: Callable[[PruneInput], PruneDecision], dry_run: bool) -> PruneReport:
        if self.read_only and not dry_run:
            raise StoreError(f"the snapshot store {self.where} is read-only: nothing removed")
        alive = self._owner_alive
        with self._removing():
            before = self.index.all_chunk_rows()
            if dry_run:
                decision = self.index.remove(decide, True, time.time(), alive)
            else:
                decision = self._with_reserve(lambda: self.index.remove(decide, False, time.time(), alive))
            swept = 0
            if not dry_run:
                still = self.index.chunk_rows(decision.chunks)
                for h in decision.chunks:
                    if h not in still and is_hash(h):  # a malformed row names no file
                        self.backend.delete(h)
                swept = self._sweep_orphans()
                self._after_removal(decision)
        freed = sum(before[h].stored_bytes for h in decision.chunks)
        return PruneReport(
            dry_run=dry_run,
            snapshots=decision.snapshots,
            chunks=len(decision.chunks),
            freed_bytes=freed,
            remaining_bytes=sum(r.stored_bytes for r in before.values()) - freed,
            swept_files=swept,
        )

    def _sweep_orphans(self) -> int:
        """Files no row names: left by a crash between a file and its row, or a row and its unlink;
        and summaries files of no snapshot's chain (its last snapshot just removed, or a crash).
        Only under the exclusive lock, where no save is between writing a file and indexing it."""
        orphans = [h for h, _ in self._orphans()]
        for h in orphans:
            self.backend.delete(h)
        stale = [h for h, _ in self._summaries_files()[1]]
        for h in stale:
            self.backend.delete_summaries(h)
        return len(orphans) + len(stale) + self.backend.sweep_temp()

    def _orphans(self) -> list[tuple[str, int]]:
        """(hash, size) of chunk files no row names."""
        indexed = self.index.all_chunk_rows()
        return [(h, n) for h, n in self.backend.list_files() if h not in indexed]

    def _summaries_files(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(last hash, size) of the summaries files of snapshots' chains, and of the others."""
        ends = self.index.chain_ends()
        files = list(self.backend.list_summaries())
        return [f for f in files if f[0] in ends], [f for f in files if f[0] not in ends]

    def _orphan_usage(self) -> tuple[int, int]:
        """(files, bytes) of orphan chunk files, summaries files of no snapshot's chain and temp
        files of interrupted saves."""
        files = self._orphans() + self._summaries_files()[1] + list(self.backend.list_temp())
        return len(files), sum(n for _, n in files)

    # checking and accounting

    def verify(self, snapshot_id: str | None = None) -> VerifyReport:
        """Reads and fully decodes every chunk of one snapshot (or of the whole store), and checks
        each snapshot's hash chain and the index's reference counts. Damage is recorded in the index
        so that prefix lookups skip it and the next save rewrites it."""
        if snapshot_id is not None:
            snap = self.get_snapshot(check_snapshot_id(snapshot_id))
            members = {snap.id: list(snap.chunk_hashes)}
            fingerprints = {snap.id: snap.fingerprint}
            rows = self.index.chunk_rows(snap.chunk_hashes)
        else:
            members = self.index.members()
            fingerprints = {s.id: s.fingerprint for s in self.index.snapshots()}
            rows = self.index.all_chunk_rows()
        holders: dict[str, list[str]] = {}
        for sid, hashes in members.items():
            for h in hashes:
                holders.setdefault(h, []).append(sid)
        report = VerifyReport(checked_snapshots=len(members), checked_chunks=len(rows))
        checked = [h for h in rows if is_hash(h)]  # malformed rows are index errors, below
        reasons = self._map(lambda i: self._check_file(checked[i], rows), len(checked))
        for h, reason in zip(checked, reasons, strict=True):
            if reason is not None:
                report.damaged.append(Damage(h, reason, tuple(holders.get(h, ()))))
            elif rows[h].damaged:
                self._set_damaged(h, None)
        for sid, hashes in members.items():
            report.index_errors += _chain_errors(sid, fingerprints.get(sid), hashes, rows)
        report.summaries = self._verify_summaries(members, fingerprints)
        if snapshot_id is None:
            report.index_errors += [f"chunk {h}: refcount disagrees" for h in self.index.refcount_errors()]
            report.index_errors += [
                f"chunk {h}: listed but not indexed" for h in self.index.dangling_members()
            ]
            report.index_errors += self.index.malformed()
            report.orphan_files, report.orphan_bytes = self._orphan_usage()
        return report

    def _verify_summaries(self, members: dict[str, list[str]], fingerprints: dict[str, str]) -> list[Damage]:
        """Every chain's summaries file read whole and checked; on a writable store one that fails
        is written again from the chunk files (as a save would have written it)."""
        chains: dict[str, list[str]] = {}
        for sid, hashes in members.items():
            if hashes and is_hash(hashes[-1]) and sid in fingerprints:  # malformed: an index error
                chains.setdefault(hashes[-1], []).append(sid)
        found = []
        for last, sids in chains.items():
            fp, hashes = fingerprints[sids[0]], members[sids[0]]
            try:
                self.summaries_file(fp, hashes)
                continue
            except ChunkError as e:
                reason = e.reason
            if not self.read_only:
                reason += self._rewrite_summaries(fp, hashes)
            found.append(Damage(last, reason, tuple(sids)))
        return found

    def _rewrite_summaries(self, fp: str, hashes: list[str]) -> str:
        """Writes a chain's summaries file from its chunk files; says how that went."""
        try:
            with self._saving():
                got = self.chunk_summaries(hashes, fp)
                parts = self._summaries_parts(fp, hashes[-1], [(s.tokens, s.summary) for s in got])
                self.backend.put_summaries(hashes[-1], parts)
        except StoreError as e:
            return f"; not written again: {e}"
        return "; written again from the chunk files"

    def _check_file(self, h: str, rows: dict[str, ChunkRow]) -> str | None:
        row = rows[h]
        try:
            blob = self._load(h, fp=row.fingerprint)
        except ChunkError as e:
            return e.reason
        if blob.index != row.index or blob.parent_hash != row.parent_hash:
            reason = "file and index disagree on the chunk's position"
            self._set_damaged(h, reason)
            return reason
        return None

    def du(self) -> DiskUsage:
        n, size = self._orphan_usage()
        live = self._summaries_files()[0]
        return DiskUsage(
            root=self.where,
            index_bytes=self._index_bytes(),
            orphan_files=n,
            orphan_bytes=size,
            summaries_files=len(live),
            summaries_bytes=sum(n for _, n in live),
            **self.index.totals(),
        )


def _check_codec(codec: str, level: int) -> None:
    if codec not in CODEC_NAMES:
        raise StoreError(f"unknown codec {codec!r}; choose one of {', '.join(CODEC_NAMES)}")
    if not -7 <= level <= 22:
        raise StoreError(f"zstd level {level} outside -7..22")


def _header_check(h: str) -> Callable[[memoryview, int], object]:
    """A file's header checked against its size before the rest is read: a padded or truncated file
    costs a header's read, not its size in memory."""
    return lambda head, size: parse_header(head, size, h)


def _f32_bytes(t: torch.Tensor) -> memoryview:
    """A summary's little-endian fp32 bytes, flat (no copy of a contiguous CPU tensor on such a host)."""
    return memoryview(np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4")).cast("B")


def _make_reserve(path: Path) -> None:
    """Best effort: no reserve where there is no room for one."""
    if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError:
        return
    try:
        os.posix_fallocate(fd, 0, RESERVE_BYTES)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _check_out(out: Sequence[torch.Tensor] | None, n: int) -> list[torch.Tensor | None]:
    if out is None:
        return [None] * n
    if len(out) != n or not all(t.device.type == "cpu" and t.is_contiguous() for t in out):
        raise StoreError(f"restore destinations must be {n} contiguous CPU tensors")
    return list(out)


def _stored_link(row: ChunkRow | None, chunk_hash: str, fingerprint: str, pos: int, parent: str) -> ChunkRow:
    """The index row of a chunk given by hash, checked to continue the chain at `pos`."""
    if row is None or row.damaged:
        raise ChunkMissing(chunk_hash, "given by hash but not stored intact; pass the chunk itself")
    if row.fingerprint != fingerprint or row.index != pos or row.parent_hash != parent:
        raise InvalidChunk(f"chunk {pos}: stored chunk {chunk_hash[:16]} does not continue the chain")
    return row


def _check_link(blob: ChunkBlob, fingerprint: str, pos: int, parent: str) -> None:
    blob.check()
    if blob.fingerprint != fingerprint:
        raise InvalidChunk(f"chunk {pos}: fingerprint {blob.fingerprint}, snapshot is {fingerprint}")
    if blob.index != pos or blob.parent_hash != parent:
        raise InvalidChunk(f"chunk {pos}: index {blob.index} or parent hash does not continue the chain")


def _chain_errors(
    sid: str, fingerprint: str | None, hashes: list[str], rows: dict[str, ChunkRow]
) -> list[str]:
    errors, parent = [], ROOT_HASH
    for pos, h in enumerate(hashes):
        row = rows.get(h)
        if row is None:
            errors.append(f"snapshot {sid} position {pos}: chunk {h} not indexed")
        elif row.index != pos or row.parent_hash != parent or row.fingerprint != fingerprint:
            errors.append(f"snapshot {sid} position {pos}: chunk {h} breaks the hash chain")
        parent = h
    return errors


def _check_meta(meta: dict) -> str:
    if not isinstance(meta, dict):
        raise StoreError("snapshot meta must be a dict")
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError(f"snapshot meta must be plain JSON: {e}") from None
    if len(text) > MAX_META_BYTES:
        raise StoreError(f"snapshot meta is {len(text)} bytes; the limit is {MAX_META_BYTES}")
    return text


def _references(inp: PruneInput) -> dict[str, int]:
    """How many snapshots list each chunk: the member lists, never the stored refcounts, decide."""
    refs = dict.fromkeys(inp.chunks, 0)
    for hashes in inp.members.values():
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
    return refs


def _plan_prune(inp: PruneInput, max_bytes: int | None, cutoff: float | None) -> PruneDecision:
    out = PruneDecision()
    refs = _references(inp)
    total = sum(r.stored_bytes for r in inp.chunks.values())
    for h, n in refs.items():
        if n == 0 and h not in inp.leased and h in inp.chunks:
            out.chunks.append(h)
            total -= inp.chunks[h].stored_bytes
    for s in sorted(inp.snapshots, key=lambda s: (s.last_used, s.created)):
        members = inp.members.get(s.id, [])
        if s.pinned or any(h in inp.leased for h in members):
            continue
        too_old = cutoff is not None and s.last_used < cutoff
        too_big = max_bytes is not None and total > max_bytes
        if not (too_old or too_big):
            continue
        out.snapshots.append(s.id)
        for h in members:
            refs[h] -= 1
            if refs[h] == 0 and h not in inp.leased and h in inp.chunks:
                out.chunks.append(h)
                total -= inp.chunks[h].stored_bytes
    return out


def _plan_rm(inp: PruneInput, snapshot_id: str) -> PruneDecision:
    snap = next((s for s in inp.snapshots if s.id == snapshot_id), None)
    if snap is None:
        return PruneDecision()
    if snap.pinned:
        raise StoreError(f"snapshot {snapshot_id} is pinned; unpin it first")
    out = PruneDecision(snapshots=[snapshot_id])
    refs = _references(inp)
    for h in inp.members.get(snapshot_id, []):
        if refs[h] == 1 and h not in inp.leased and h in inp.chunks:
            out.chunks.append(h)
    return out
