"""`ChunkReader`: chunk files read back and decoded, every check passed, on a store's threads or its
worker processes (kvflash/storage/workers.py).

A read trusts the index only to say which chunks should be there: each file's checksums and chain
hash are checked again. Damage a read finds is marked in the index (best effort), so prefix lookups
skip the chunk and the next save of it rewrites it; the caller still gets the error.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from functools import partial

import torch

from kvflash.storage.backend import ReadBuffer
from kvflash.storage.chunk import ChunkBlob
from kvflash.storage.context import StoreContext
from kvflash.storage.errors import ChunkCorrupt, ChunkError, ChunkMissing, ForeignFingerprint, StoreError
from kvflash.storage.format import (
    HEADER_SIZE,
    MAX_FILE_BYTES,
    ChunkHeader,
    check_file,
    decode_chunk,
    parse_header,
)
from kvflash.storage.names import check_hash
from kvflash.storage.threads import Threads
from kvflash.storage.workers import StoreWorkers, WorkerFailed


class ChunkReader:
    def __init__(self, ctx: StoreContext, workers: StoreWorkers | None = None):
        """With `workers`, batch reads decode in those worker processes once one has started."""
        self.backend, self.index, self.threads = ctx.backend, ctx.index, ctx.threads
        self.read_only = ctx.read_only
        self.workers = workers
        self._drivers = Threads(workers.n, "kvflash-drive") if workers is not None else None
        self._hints = Threads(1, "kvflash-hint")
        self._local = threading.local()
        self.fetched: Callable[[str, int], None] | None = None
        """Sees the hash and size of every chunk read and verified (a tier in front copies them to
        itself)."""

    def close(self) -> None:
        self._hints.shutdown(cancel_futures=True)
        if self._drivers is not None:
            self._drivers.shutdown()

    def read_chunk(
        self,
        chunk_hash: str,
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
        with_summary: bool = True,
    ) -> ChunkBlob:
        """One chunk, every checksum and the chain hash verified; ChunkError subclasses otherwise.
        `out` (a contiguous CPU tensor, e.g. a host-tier slot) receives the KV and sets the expected
        shape and dtype; it is written only after every check has passed. `with_summary=False`: the
        blob's summary is None (see format.decode_chunk)."""
        outs = None if out is None else [out]
        return self.read_chunks_parallel(
            [chunk_hash], expect_fingerprint, expect_shape, expect_dtype, outs, with_summary
        )[0]

    def read_chunks_parallel(
        self,
        hashes: Sequence[str],
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: Sequence[torch.Tensor] | None = None,
        with_summary: bool = True,
    ) -> list[ChunkBlob]:
        """Chunks in the given order (into `out[i]` where given); reads and decodes run on the pool.
        `with_summary=False` (restores: their summaries come from the summaries file) spares each
        chunk its summary, which is then None."""
        outs = _check_out(out, len(hashes))
        self.check_rows(hashes, expect_fingerprint)
        if len(hashes) > 1:
            # On a thread of its own: once the disk's queue is full each hint blocks, and hinting a
            # thousand chunks before the first decode left the workers idle for most of the read.
            self._hints.submit(self.backend.will_need, list(hashes))
        if self.workers is not None and self.workers.ready and len(hashes) > 1:
            shape = None if expect_shape is None else tuple(expect_shape)
            try:
                return self._read_in_processes(
                    hashes, expect_fingerprint, shape, expect_dtype, outs, with_summary
                )
            except WorkerFailed:
                pass  # the threads below read every chunk again, and report their own errors
        load = partial(
            self.load,
            fp=expect_fingerprint,
            shape=expect_shape,
            dtype=expect_dtype,
            stored_crc=False,
            with_summary=with_summary,
        )
        return self.threads.map(lambda i: load(hashes[i], outs[i]), len(hashes))

    def _read_in_processes(
        self,
        hashes: Sequence[str],
        fp: str,
        shape: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        outs: list[torch.Tensor | None],
        with_summary: bool,
    ) -> list[ChunkBlob]:
        """Runs of consecutive chunks, a few per worker so a slow one does not hold up the end, each
        driven by a thread that waits on its worker and copies its output."""
        assert self.workers is not None and self._drivers is not None
        n_runs = min(len(hashes), 4 * self.workers.n)
        bounds = [len(hashes) * i // n_runs for i in range(n_runs + 1)]

        def run(i: int) -> list[ChunkBlob]:
            lo, hi = bounds[i], bounds[i + 1]
            try:
                return self.workers.read(hashes[lo:hi], fp, shape, dtype, outs[lo:hi], with_summary)
            except ChunkError as e:
                self.mark(e)
                raise

        runs = self._drivers.map(run, n_runs)
        return [blob for blobs in runs for blob in blobs]

    def chunk_file(self, chunk_hash: str) -> bytes:
        """A chunk's file as stored, its checksums and chain hash checked but its KV not decoded:
        what a copy to another store sends."""
        h = check_hash(chunk_hash)
        try:
            buf = self.backend.get(h, MAX_FILE_BYTES, None, HEADER_SIZE, _header_check(h))
            check_file(buf, h)
        except ChunkError as e:
            self.mark(e)
            raise
        return bytes(buf)

    def read_header(self, chunk_hash: str) -> ChunkHeader:
        buf, size = self.backend.get_range(check_hash(chunk_hash), 0, HEADER_SIZE)
        return parse_header(buf, size, chunk_hash)

    def check_rows(self, hashes: Sequence[str], fingerprint: str) -> None:
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

    def load(
        self,
        h: str,
        out: torch.Tensor | None = None,
        *,
        fp: str,
        shape: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        stored_crc: bool = True,
        with_summary: bool = True,
    ) -> ChunkBlob:
        """One chunk file read and decoded. `stored_crc=False` and `with_summary=False` on restores:
        see format.decode_chunk; `verify` checks every checksum."""
        if not hasattr(self._local, "buffer"):
            self._local.buffer = ReadBuffer()
        try:
            buf = self.backend.get(h, MAX_FILE_BYTES, self._local.buffer, HEADER_SIZE, _header_check(h))
        except ChunkError as e:
            self.mark(e)
            raise
        try:
            blob = decode_chunk(buf, h, fp, shape, dtype, out, stored_crc, with_summary)
        except ChunkError as e:
            # the index vouched for this fingerprint, so a foreign one in the file is damage too
            self.mark(e)
            raise
        if self.fetched is not None:
            self.fetched(h, len(buf))
        return blob

    def mark(self, e: ChunkError) -> None:
        if isinstance(e, ChunkCorrupt | ChunkMissing | ForeignFingerprint):
            self.set_damaged(e.chunk_hash, e.reason)

    def set_damaged(self, h: str, reason: str | None) -> None:
        """Best effort (a full disk, a busy or read-only index): the caller still gets the real error."""
        if self.read_only:
            return
        try:
            self.index.mark_damaged(h, reason)
        except (StoreError, sqlite3.Error):
            pass


def _header_check(h: str) -> Callable[[memoryview, int], object]:
    """A file's header checked against its size before the rest is read: a padded or truncated file
    costs a header's read, not its size in memory."""
    return lambda head, size: parse_header(head, size, h)


def _check_out(out: Sequence[torch.Tensor] | None, n: int) -> list[torch.Tensor | None]:
    if out is None:
        return [None] * n
    if len(out) != n or not all(t.device.type == "cpu" and t.is_contiguous() for t in out):
        raise StoreError(f"restore destinations must be {n} contiguous CPU tensors")
    return list(out)
