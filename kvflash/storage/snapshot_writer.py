"""`SnapshotWriter`: snapshots saved, and snapshots copied in from another store.

A save writes the chunk files it lacks and its chain's summaries file, each durable, before the one
index transaction that names them; on any failure it leaves the store as it was (kvflash/storage/
store.py states the ordering rules). Chunks are encoded and written by the store's worker processes
where it has them (kvflash/storage/workers.py), else by its threads.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from kvflash.storage.chunk import ROOT_HASH, ChunkBlob, ChunkSummary, token_bytes
from kvflash.storage.codec import CODEC_NAMES
from kvflash.storage.context import StoreContext
from kvflash.storage.errors import ChunkMissing, InvalidChunk, StoreError
from kvflash.storage.format import check_file, encode_chunk
from kvflash.storage.names import check_fingerprint, check_hash, check_label, check_snapshot_id
from kvflash.storage.records import ChunkRow, Snapshot
from kvflash.storage.summaries import HeadRead, check_summaries_file, entry_crc, pack_head, summary_frame
from kvflash.storage.summary_reader import SummaryReader
from kvflash.storage.workers import StoreWorkers, WorkerFailed

MAX_META_BYTES = 1 << 20


class SnapshotWriter:
    def __init__(
        self,
        ctx: StoreContext,
        summaries: SummaryReader,
        codec: str,
        level: int,
        processes: StoreWorkers | None = None,
        save_threads: int | None = None,
    ):
        self.backend, self.index, self.threads = ctx.backend, ctx.index, ctx.threads
        self.processes = processes
        self.in_flight = 2 * self.threads.n if save_threads is None else min(save_threads, self.threads.n)
        """Chunks a save has queued or encoding: twice the threads, so that none waits for work, or
        `save_threads`, where a caller bounds how many of them a save keeps busy."""
        self.coordination, self.where, self.read_only = ctx.coordination, ctx.where, ctx.read_only
        self.summaries = summaries
        self.codec = CODEC_NAMES[codec]
        self.level = level
        self.quiet: threading.Event | None = None
        """Where set (`yield_to`): a save encodes its next chunk once this is set, or once it has
        waited `max_yield_s` in all."""
        self.max_yield_s = 0.0

    def yield_to(self, quiet: threading.Event, max_wait_s: float) -> None:
        """Saves wait for `quiet` before each chunk they encode, up to max_wait_s a save in all: a
        server's saves encode on the interpreter its scheduler runs on, and a request waiting for its
        first token should not share it with a background save (the wait bounds how late a save
        ends under steady load)."""
        self.quiet, self.max_yield_s = quiet, max_wait_s

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
            with self.coordination.saving():
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
        patience = self.max_yield_s
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
                        if self.quiet is not None and patience > 0 and not self.quiet.is_set():
                            t0 = time.monotonic()
                            self.quiet.wait(patience)
                            patience -= time.monotonic() - t0
                        written.append(h)
                        pending.append(self.threads.submit(self._store_one, item))
                        while len(pending) >= self.in_flight:
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
        if self.processes is not None and self.processes.ready:
            try:
                return self.processes.write(blob, self.codec, self.level)
            except WorkerFailed:
                pass  # this thread writes it (a store error the worker met raised above)
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
        its name to `out` first). The chunks before the first this save wrote come, as stored, from
        the summaries file of a snapshot whose chain starts with them where there is one (a turn's
        save extends the chain it restored: its summaries are not compressed again). Past them a
        chunk this save wrote gives its own token ids and summary, a `known` one those read before,
        every other those its chunk file holds (read back): the file holds what the chunk files
        hold. Best effort, as the file only spares reads: without it the snapshot restores per
        chunk."""
        last = hashes[-1]
        try:
            if self.summaries.has_summaries(fp, hashes):
                return
            new = set(written)
            head = next((i for i, h in enumerate(hashes) if h in new), len(hashes))
            stored = self.summaries.stored_frames(hashes[:head], fp) if head else None
            first = len(stored.hashes) if stored is not None else 0
            entries = {
                i: (x.tokens, x.summary)
                for i, x in enumerate(items)
                if i >= first and isinstance(x, ChunkBlob) and x.chain_hash in new
            }
            for i, k in enumerate(known[: len(hashes)]):
                if i >= first and i not in entries and k.chain_hash == hashes[i]:
                    entries[i] = (k.tokens, k.summary)
            old = [i for i in range(first, len(hashes)) if i not in entries]
            if old:
                read = self.summaries.read_summaries([hashes[i] for i in old], fp)
                entries.update((i, (s.tokens, s.summary)) for i, s in zip(old, read, strict=True))
            parts = self.summaries_parts(fp, last, [entries[i] for i in range(first, len(hashes))], stored)
            out.append(last)
            self.backend.put_summaries(last, parts)
        except StoreError as e:
            warnings.warn(f"snapshot saved without its summaries file: {e}", stacklevel=4)

    def summaries_parts(
        self,
        fp: str,
        last: str,
        entries: list[tuple[list[int], torch.Tensor]],
        stored: HeadRead | None = None,
    ) -> list[bytes | memoryview]:
        """The summaries file of a chain ending at `last`, as parts to write: the `stored` head's
        entries as they were read (`SummaryReader.stored_frames`), then `entries`, whose checksums
        and frames are made on the pool."""
        tokens = [token_bytes(t) for t, _ in entries]
        rows = [_f32_bytes(s) for _, s in entries]
        if stored is not None:
            c, shape = stored.header.chunk_tokens, stored.header.summary_shape
        else:
            c, shape = len(entries[0][0]), tuple(entries[0][1].shape)
        if any(len(t) != 4 * c for t in tokens) or any(tuple(s.shape) != shape for _, s in entries):
            raise InvalidChunk("the chain's chunks differ in length or summary shape")
        crcs = self.threads.map(lambda i: entry_crc(tokens[i], rows[i]), len(entries))
        frames = self.threads.map(lambda i: summary_frame(entries[i][1], self.level), len(entries))
        lens = [len(f) for f in frames]
        if stored is not None:
            n = len(stored.hashes)
            crcs, lens = [*stored.crcs[:n].tolist(), *crcs], [*stored.frame_lens(), *lens]
            tokens, frames = [stored.tokens, *tokens], [stored.frames, *frames]
        return [pack_head(fp, last, c, shape, crcs, lens), *tokens, *frames]

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
            with self.coordination.saving():
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
            warnings.warn(f"snapshot copied without its summaries file: {e}", stacklevel=4)

    def _remove_unindexed(self, hashes: list[str], summaries: Sequence[str] = ()) -> None:
        """After a failed save: its chunk files that no index row names, its summaries file if no
        snapshot has that chain (none can be mid-save: exclusive). Where failed saves' files expire
        by themselves, nothing. Best effort: the save's own error is the one to raise, and files left
        here are orphans the next prune sweeps."""
        if self.coordination.failed_saves_expire:
            return
        try:
            with self.coordination.removing():
                indexed = self.index.chunk_rows(hashes)
                for h in hashes:
                    if h not in indexed:
                        self.backend.delete(h)
                ends = self.index.chain_ends() if summaries else set()
                for h in summaries:
                    if h not in ends:
                        self.backend.delete_summaries(h)
        except (StoreError, OSError) as e:
            warnings.warn(f"a failed save's files stay until the next prune: {e}", stacklevel=3)


def check_codec(codec: str, level: int) -> None:
    if codec not in CODEC_NAMES:
        raise StoreError(f"unknown codec {codec!r}; choose one of {', '.join(CODEC_NAMES)}")
    if not -7 <= level <= 22:
        raise StoreError(f"zstd level {level} outside -7..22")


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


def _stored_link(row: ChunkRow | None, chunk_hash: str, fingerprint: str, pos: int, parent: str) -> ChunkRow:
    """The index row of a chunk given by hash, checked to continue the chain at `pos`."""
    if row is None or row.damaged:
        raise ChunkMissing(chunk_hash, "given by hash but not stored intact; pass the chunk itself")
    if row.fingerprint != fingerprint or row.index != pos or row.parent_hash != parent:
        raise InvalidChunk(f"chunk {pos}: stored chunk {chunk_hash[:16]} does not continue the chain")
    return row


def _check_link(blob: ChunkBlob, fingerprint: str, pos: int, parent: str) -> None:
    blob.check()
    if blob.summary is None:
        raise InvalidChunk(f"chunk {pos}: no summary (read with with_summary=False); a saved chunk needs one")
    if blob.fingerprint != fingerprint:
        raise InvalidChunk(f"chunk {pos}: fingerprint {blob.fingerprint}, snapshot is {fingerprint}")
    if blob.index != pos or blob.parent_hash != parent:
        raise InvalidChunk(f"chunk {pos}: index {blob.index} or parent hash does not continue the chain")


def _f32_bytes(t: torch.Tensor) -> memoryview:
    """A summary's little-endian fp32 bytes, flat (no copy of a contiguous CPU tensor on such a host)."""
    return memoryview(np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4")).cast("B")
