"""Between a live sequence and the disk store: save a chunk-aligned prefix, find and restore one.

A restore is a transaction (docs/DESIGN.md: Scheduler): chunks are leased, read and validated into host-tier
slots, and only then does the sequence adopt them (the caller counts the hit once the restore is
validated). Any failure leaves the sequence empty and the stored copy untouched, and the caller
prefills cold. A lazy restore reads
only token ids and summaries up front; chunk KV is read when residency selects the chunk, and a
background thread prefetches the rest into the host tier after the answer.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvflash.engine.host_tier import HostTier
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import chunk_shape
from kvflash.storage import (
    ROOT_HASH,
    ChunkBlob,
    ChunkSummary,
    InvalidChunk,
    SnapshotInfo,
    SnapshotStore,
    chain_hashes,
)

APPROX_SUFFIX = "+approx"
"""Fingerprint suffix of chunks whose KV was computed without every earlier chunk resident (a budget
below the context): they hash apart from exact KV, so they never stand in for it."""
LOOKUP_SPAN = 64
"""Chunks a lookup hashes and checks first; each further span is twice the last (`_stored_chain`)."""
PREFETCH_PAUSE_S = 0.001
"""Between prefetch batches, so that a selection waiting for the fetch lock gets it."""
STAGE_CHUNKS = 64
"""Chunks gathered on the device per copy when staging: one gather and one device-to-host copy a
group, instead of a copy (and a wait) a chunk, in a few tens of MB of device memory."""


@dataclass
class RestoreStats:
    tokens: int = 0


@dataclass
class StoredSummaries:
    """Token ids and key summaries of stored chunks, in chain order, as the store read them."""

    read: list[ChunkSummary]
    rows: torch.Tensor
    """[n, L, Hkv, B, D] fp32 on the CPU: the summaries of `read`, which are views of it."""

    @property
    def hashes(self) -> list[str]:
        return [s.chain_hash for s in self.read]

    @property
    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.read]

    def head(self, n: int) -> StoredSummaries:
        return StoredSummaries(self.read[:n], self.rows[:n])


@dataclass
class StagedSnapshot:
    """A sealed prefix ready to write: its fingerprint and, in chain order, the hash of each chunk the
    store holds or a blob of each it lacks. A blob's KV is its own copy, or a host-tier slot the
    snapshot holds a reference to until it is written (host copies are never rewritten); on CUDA
    the copies, and the summaries', may still be in flight until the events of `copied` are done."""

    fp: str
    items: list[ChunkBlob | str]
    host: HostTier | None = None
    held: list[int] = field(default_factory=list)
    copied: list[torch.cuda.Event] = field(default_factory=list)
    taken: int = 0
    """Host slots taken from the tier's free ones to copy chunks into (of `held`): the room a
    server's staging uses, which comes back when the snapshot is written."""

    def ready(self) -> None:
        """Waits for the copies in flight (on the thread that writes the snapshot)."""
        for done in self.copied:
            done.synchronize()

    def release(self) -> None:
        """Gives the held host slots back once the blobs are written or dropped (idempotent)."""
        if self.host is not None and self.held:
            self.ready()  # a copy still in flight writes the slot
            self.host.release_many(self.held)
            self.held = []


class KVSnapshots:
    """Saves and restores one model's sequences through a SnapshotStore, under two fingerprints:
    the model's for exact KV, the model's + APPROX_SUFFIX for KV computed under eviction."""

    def __init__(
        self,
        store: SnapshotStore,
        fingerprint: str,
        prefetch: bool = True,
        other_kv: Mapping[str, str] | None = None,
    ):
        self.store, self.fp, self.prefetch = store, fingerprint, prefetch
        self.approx_fp = fingerprint + APPROX_SUFFIX
        self.other_kv = dict(other_kv or {})
        """Fingerprints of this model's KV in other dtypes, to the dtype's name: their snapshots hold
        this model's token ids, but never KV that this engine restores."""

    def other_kv_dtype(self, fp: str) -> str | None:
        """The KV dtype of a snapshot of this model stored under another KV dtype (exact or
        approximate KV), else None."""
        return self.other_kv.get(fp.removesuffix(APPROX_SUFFIX))

    def other_kv_counts(self) -> dict[str, int]:
        """Snapshots of this model stored under another KV dtype, counted by that dtype: a server
        started with another --kv-dtype restores none of them."""
        counts: dict[str, int] = {}
        for snap in self.store.list_snapshots():
            if name := self.other_kv_dtype(snap.fingerprint):
                counts[name] = counts.get(name, 0) + 1
        return counts

    def read_summaries(self, fp: str, hashes: list[str], shape: tuple[int, ...]) -> StoredSummaries:
        rows = torch.empty((len(hashes), *shape))
        return StoredSummaries(self.store.read_summaries(hashes, fp, rows), rows)

    def save(
        self, kv: PagedKV, label: str, meta: dict | None = None, known: StoredSummaries | None = None
    ) -> str:
        """Snapshots the sealed prefix as its label's newest (`replace`), writing only chunks the
        store does not already hold; `known`, summaries read for the sequence's restore, are not
        read again for the snapshot's summaries file."""
        return self.replace(self.stage(kv), label, meta, known)

    def stage(self, kv: PagedKV) -> StagedSnapshot:
        """The sealed prefix's chain, with a copy of the KV of every chunk the store lacks: `put`
        may then run while the sequence goes on (and its slots are reused). On CUDA the summaries'
        copy, and the copies of resident chunks into free host-tier slots, are queued behind the
        device's work, not waited for: a server stages on its scheduler's thread, which would
        otherwise drain the device for each answer that ends (the step launched ahead of its
        tokens' read-back included). Chunks the tier has no free slot for are copied at once."""
        n = kv.seq.n_sealed
        fp = self.approx_fp if kv.approximate else self.fp
        hashes = kv.chain_hashes(fp, n)
        stored = self.store.find_longest_prefix(fp, hashes)
        items: list[ChunkBlob | str] = list(hashes[:stored])
        if stored == n:
            return StagedSnapshot(fp, items)
        staged = StagedSnapshot(fp, items)
        summaries = _host_copy(kv.seq.summaries[stored:n], staged)
        try:
            held = _host_copies(kv, range(stored, n), staged)
            copies = _resident_copies(kv, [i for i in range(stored, n) if i not in held])
            for i in range(stored, n):
                parent = hashes[i - 1] if i else ROOT_HASH
                if i in held:
                    data = kv.host.view(held[i])
                else:
                    data = copies[i] if i in copies else kv.chunk_kv(i).to("cpu", copy=True)
                tokens = kv.seq.chunk_tokens_of(i)
                items.append(ChunkBlob(fp, i, hashes[i], parent, tokens, summaries[i - stored], data))
        except BaseException:
            staged.release()
            raise
        return staged

    def put(
        self,
        staged: StagedSnapshot,
        label: str,
        meta: dict | None = None,
        succeeds: Sequence[str] = (),
        known: StoredSummaries | None = None,
    ) -> str:
        """Writes a staged snapshot (compressing its new chunks); returns its id."""
        read = known.read if known is not None else ()
        try:
            staged.ready()
            return self.store.put_snapshot(label, staged.fp, staged.items, meta, succeeds, read)
        finally:
            staged.release()

    def usable(self, fp: str) -> bool:
        """Whether this engine can restore KV stored under fp: exact KV, or approximate KV (which a
        sequence that evicts anyway takes)."""
        return fp in (self.fp, self.approx_fp)

    def superseded(self, label: str, fp: str) -> list[SnapshotInfo]:
        """The label's snapshots that a new one under fp replaces: unpinned, of this engine, and
        exact KV replaces approximate KV (it stands in for it) but approximate KV never exact. A
        snapshot of another model, dtype or chunk size stays: its engine still needs it."""
        kinds = (self.fp, self.approx_fp) if fp == self.fp else (fp,)
        snaps = self.store.list_snapshots()
        return [s for s in snaps if s.label == label and s.fingerprint in kinds and not s.pinned]

    def replace(
        self,
        staged: StagedSnapshot,
        label: str,
        meta: dict | None = None,
        known: StoredSummaries | None = None,
    ) -> str:
        """Writes a staged snapshot as its label's newest, taking over the hits of the snapshots it
        `superseded`, then removes those. A store error raises with nothing changed; a removal that
        fails only warns: the new snapshot is written and the old one is still valid."""
        try:
            previous = [s.id for s in self.superseded(label, staged.fp)]
        except BaseException:
            staged.release()
            raise
        sid = self.put(staged, label, meta, previous, known)
        for old in previous:
            try:
                self.store.rm(old)
            except Exception as e:
                warnings.warn(f"could not remove the replaced snapshot {old}: {e}", stacklevel=2)
        return sid

    def lookup(self, ids: list[int], chunk_tokens: int, approximate: bool) -> tuple[str, list[str]]:
        """(fingerprint, hashes) of the longest stored chunk-aligned prefix of ids, leaving one token
        to compute: exact KV, or with `approximate` (a sequence that evicts anyway) approximate KV
        where it covers more."""
        best: tuple[str, list[str]] = (self.fp, [])
        for fp in (self.fp, self.approx_fp) if approximate else (self.fp,):
            hashes = self._stored_chain(fp, ids[: len(ids) - 1], chunk_tokens)
            if len(hashes) > len(best[1]):
                best = (fp, hashes)
        return best

    def _stored_chain(self, fp: str, ids: list[int], chunk_tokens: int) -> list[str]:
        """The chain hashes of the longest stored prefix of ids' chunks under fp, hashed and checked
        a span at a time (each twice the last) up to the first span the store does not hold whole:
        a prompt stored under the other fingerprint, or not at all, costs a span, not its length."""
        n, c = len(ids) // chunk_tokens, chunk_tokens
        hashes: list[str] = []
        span = LOOKUP_SPAN
        while len(hashes) < n:
            lo, hi = len(hashes), min(n, len(hashes) + span)
            more = chain_hashes(fp, ids[lo * c : hi * c], c, hashes[-1] if hashes else ROOT_HASH)
            stored = self.store.find_longest_prefix(fp, more)
            hashes += more[:stored]
            if stored < len(more):
                break
            span *= 2
        return hashes

    def restore(
        self,
        kv: PagedKV,
        fp: str,
        hashes: list[str],
        lazy: bool,
        leases: contextlib.ExitStack,
        on_progress: Callable[[int, int], None] | None = None,
        batch: int = 64,
        ahead: StoredSummaries | None = None,
    ) -> RestoreStats:
        """Restores the chunks named by hashes (stored under `fp`) into an empty sequence. Anything
        that fails (ChunkError, a full host tier, an index error) raises with the sequence still
        empty and the host slots it took released; the sequence adopts the chunks only once
        everything is read and checked. The caller records the hit (`SnapshotStore.record_hit`).

        The lease is entered on `leases`, which the caller closes when the sequence is done with
        the store (a lazy sequence reads from it until then). on_progress(chunks done, total)
        follows an eager read, which goes in batches so it can report. `ahead`, summaries read
        earlier (a session takes a document's ids from them), spares reading those it covers.
        """
        assert not len(kv.seq), "restore needs an empty sequence"
        if not hashes:
            return RestoreStats()
        c = kv.cfg.chunk_tokens
        shape = chunk_shape(kv.pool.cfg, c)
        leases.enter_context(self.store.lease(hashes))
        if lazy:  # the first selection reads up to a budget of chunks into host slots: pin them now
            kv.host.reserve(kv.host.n_used + min(kv.budget, len(hashes)))
        slots: list[int] = []
        try:
            if ahead is not None and ahead.hashes[: len(hashes)] == list(hashes):
                summaries = ahead.head(len(hashes))
            else:
                summaries = self.read_summaries(fp, hashes, tuple(kv.summary_shape))
            if any(len(t) != c for t in summaries.tokens):
                raise InvalidChunk(f"a stored chunk does not hold {c} tokens")
            if not lazy:
                slots = kv.host.alloc_many(len(hashes))  # none kept where the host tier is full
                for lo in range(0, len(hashes), batch):
                    outs = [kv.host.view(h) for h in slots[lo : lo + batch]]
                    self.store.read_chunks_parallel(
                        hashes[lo : lo + batch], fp, shape, kv.pool.kv.dtype, outs, with_summary=False
                    )
                    if on_progress:
                        on_progress(min(lo + batch, len(hashes)), len(hashes))
            rows = summaries.rows.to(kv.device, non_blocking=True)  # staged from pageable memory: no wait
        except BaseException:
            for h in slots:
                kv.host.release(h)
            raise
        kv.adopt(
            fp,
            hashes,
            summaries.tokens,
            rows,
            approximate=fp == self.approx_fp,
            host_slots=None if lazy else slots,
            fetch=self._fetcher(fp, shape, kv.pool.kv.dtype) if lazy else None,
        )
        return RestoreStats(len(hashes) * c)

    def _fetcher(self, fp, shape, dtype):
        def fetch(hashes: list[str], outs: list[torch.Tensor]) -> None:
            self.store.read_chunks_parallel(hashes, fp, shape, dtype, out=outs, with_summary=False)

        return fetch

    def start_prefetch(self, kv: PagedKV) -> None:
        """Starts reading a lazy sequence's remaining chunks in the background. Called after the
        answer: during decode its decoding threads would take the GIL from the token loop
        (docs/BENCHMARKS.md: Sessions), and the next question is what the prefetch is for."""
        if self.prefetch and kv.fetch is not None:
            threading.Thread(target=self._prefetch, args=(kv,), daemon=True, name="kvflash-prefetch").start()

    @staticmethod
    def _prefetch(kv: PagedKV, batch: int = 16) -> None:
        """Reads every still disk-only chunk into the host tier, most relevant first, in batches
        small enough that a selection waiting for the lock waits for one batch at most."""
        order = sorted(kv.seq.chunks, key=lambda ch: ch.score, reverse=True)
        for lo in range(0, len(order), batch):
            if kv.fetch is None:
                return
            try:
                kv.load_to_host(order[lo : lo + batch])
            except Exception:  # selection retries the chunk and reports; prefetch is best effort
                return
            time.sleep(PREFETCH_PAUSE_S)  # locks are not fair: let a waiting selection take it


def _host_copies(kv: PagedKV, indices: range, staged: StagedSnapshot) -> dict[int, int]:
    """Host-tier slots holding the KV of chunks among `indices`, by index, each held for `staged`:
    the host copies the tier already has (the sequence's own, or a named copy of the same chunk),
    then copies of resident chunks into free host slots, queued without waiting (`HostTier.copy_out`).
    The caller's thread, a server's scheduler, goes on at once instead of waiting for the bytes, and
    a named chunk's new host copy serves other sequences too. The rest is for the caller to copy."""
    host, out = kv.host, {}
    staged.host = host
    for i in indices:
        ch = kv.seq.chunks[i]
        if ch.host is not None:
            host.hold(ch.host)
            out[i] = ch.host
        elif ch.key is not None and (h := host.share(ch.key)) is not None:
            out[i] = h
        else:
            continue
        staged.held.append(out[i])
    resident = [i for i in indices if i not in out and kv.seq.chunks[i].gpu is not None]
    slots, done = host.copy_out([kv.seq.chunks[i].gpu for i in resident])
    if done is None and out and host.cuda:  # a held copy may still be landing (a page-out, or
        done = host.landed()  # another snapshot's copy_out): its stream orders them all
    staged.held += slots
    staged.copied += [done] if done is not None else []
    staged.taken = len(slots)
    for i, h in zip(resident, slots, strict=False):
        out[i] = h
        if (key := kv.seq.chunks[i].key) is not None:
            host.publish(key, h)
    if len(slots) < len(resident):  # room for the next snapshot, allocated in the background
        host.reserve(host.n_used + len(resident) - len(slots), later=True)
    return out


def _host_copy(src: torch.Tensor, staged: StagedSnapshot) -> torch.Tensor:
    """A host copy of a device tensor that the caller does not wait for: on CUDA, into pinned memory
    behind the stream's work, with an event in `staged.copied` for the writer to wait on."""
    if src.device.type != "cuda":
        return src.to("cpu", copy=True)
    out = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(src.device))
    staged.copied.append(done)
    return out


def _resident_copies(kv: PagedKV, indices: list[int]) -> dict[int, torch.Tensor]:
    """Host copies of the KV of the chunks among `indices` that are in the pool, by index."""
    resident = [i for i in indices if kv.seq.chunks[i].gpu is not None]
    out: dict[int, torch.Tensor] = {}
    for lo in range(0, len(resident), STAGE_CHUNKS):
        group = resident[lo : lo + STAGE_CHUNKS]
        slots = torch.tensor([kv.seq.chunks[i].gpu for i in group], device=kv.device)
        block = kv.pool.kv.index_select(0, slots).to("cpu")
        out.update(zip(group, block, strict=True))
    return out
