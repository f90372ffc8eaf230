"""`Maintenance`: what keeps a store within its bounds and honest about its contents: removal (`rm`,
`prune`, the orphan sweep), `verify` and `du`, with their reports.

A removal decides and deletes rows in one index transaction, under the exclusive store lock, before
it unlinks any file; pinned snapshots and leased chunks stay (kvflash/storage/store.py states the
ordering rules).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial

from kvflash.storage.chunk import ROOT_HASH
from kvflash.storage.chunk_reader import ChunkReader
from kvflash.storage.context import StoreContext
from kvflash.storage.errors import ChunkError, StoreError
from kvflash.storage.names import check_snapshot_id, is_hash
from kvflash.storage.records import ChunkRow, PruneDecision, PruneInput, Snapshot
from kvflash.storage.snapshot_writer import SnapshotWriter
from kvflash.storage.summary_reader import SummaryReader


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


class Maintenance:
    def __init__(
        self, ctx: StoreContext, chunks: ChunkReader, summaries: SummaryReader, writer: SnapshotWriter
    ):
        self.backend, self.index, self.threads = ctx.backend, ctx.index, ctx.threads
        self.coordination, self.where, self.read_only = ctx.coordination, ctx.where, ctx.read_only
        self.chunks, self.summaries, self.writer = chunks, summaries, writer

    # removal

    def rm(self, snapshot_id: str) -> PruneReport:
        """Removes one snapshot and the chunks only it held (those leased stay until released), and
        its chain's summaries file where no snapshot left ends there. It reads and sweeps nothing
        else of the store (orphans a crash left go at the next prune): a session's every save
        removes the snapshot it replaces."""
        snap = self.index.snapshot(check_snapshot_id(snapshot_id))
        return self._remove(partial(_plan_rm, snapshot_id=snapshot_id), dry_run=False, only=snap)

    def prune(
        self,
        max_bytes: int | None = None,
        older_than: float | None = None,
        dry_run: bool = False,
        keep: Collection[str] = (),
    ) -> PruneReport:
        """Least recently used snapshots first, until stored bytes fit max_bytes; also every snapshot
        unused for older_than seconds. Pinned snapshots, the snapshots of `keep` and leased chunks
        stay. Chunks no snapshot names go first, under the same budget and cutoff (all of them with
        neither); orphan files and temp files of interrupted saves always go."""
        cutoff = time.time() - older_than if older_than is not None else None
        policy = partial(_plan_prune, max_bytes=max_bytes, cutoff=cutoff, keep=frozenset(keep))
        return self._remove(policy, dry_run)

    def _remove(
        self, decide: Callable[[PruneInput], PruneDecision], dry_run: bool, only: Snapshot | None = None
    ) -> PruneReport:
        """`only`: the snapshot `decide` is about alone (`rm`): the index decides on a view of it,
        and its summaries file is the only one that may go."""
        if self.read_only and not dry_run:
            raise StoreError(f"the snapshot store {self.where} is read-only: nothing removed")
        alive = self.coordination.owner_alive
        one = None if only is None else only.id
        with self.coordination.removing():
            if dry_run:
                decision = self.index.remove(decide, True, time.time(), alive, one)
            else:
                decision = self.coordination.with_reserve(
                    lambda: self.index.remove(decide, False, time.time(), alive, one)
                )
            swept = 0
            if not dry_run:
                still = self.index.chunk_rows(decision.chunks)
                for h in decision.chunks:
                    if h not in still and is_hash(h):  # a malformed row names no file
                        self.backend.delete(h)
                if only is None:
                    swept = self._sweep_orphans()
                elif decision.snapshots and self._unused_file(last := only.chunk_hashes[-1:]):
                    self.backend.delete_summaries(last[0])
                    swept = 1
                self.coordination.after_removal(decision.gone_owners)
        return PruneReport(
            dry_run=dry_run,
            snapshots=decision.snapshots,
            chunks=len(decision.chunks),
            freed_bytes=decision.freed_bytes,
            remaining_bytes=decision.remaining_bytes,
            swept_files=swept,
        )

    def _unused_file(self, last: tuple[str, ...]) -> bool:
        """Whether a removed chain's summaries file, named by its last chunk (`last`: that hash, or
        none where the snapshot listed no chunk), serves no snapshot left; a malformed row names no
        file."""
        return bool(last) and is_hash(last[0]) and not self.index.ends_a_chain(last[0])

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
            snap = self.index.snapshot(check_snapshot_id(snapshot_id))
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
        reasons = self.threads.map(lambda i: self._check_file(checked[i], rows), len(checked))
        for h, reason in zip(checked, reasons, strict=True):
            if reason is not None:
                report.damaged.append(Damage(h, reason, tuple(holders.get(h, ()))))
            elif rows[h].damaged:
                self.chunks.set_damaged(h, None)
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
                self.summaries.summaries_file(fp, hashes)
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
            with self.coordination.saving():
                got = self.summaries.chunk_summaries(hashes, fp)
                parts = self.writer.summaries_parts(fp, hashes[-1], [(s.tokens, s.summary) for s in got])
                self.backend.put_summaries(hashes[-1], parts)
        except StoreError as e:
            return f"; not written again: {e}"
        return "; written again from the chunk files"

    def _check_file(self, h: str, rows: dict[str, ChunkRow]) -> str | None:
        row = rows[h]
        try:
            blob = self.chunks.load(h, fp=row.fingerprint)
        except ChunkError as e:
            return e.reason
        if blob.index != row.index or blob.parent_hash != row.parent_hash:
            reason = "file and index disagree on the chunk's position"
            self.chunks.set_damaged(h, reason)
            return reason
        return None

    def du(self) -> DiskUsage:
        n, size = self._orphan_usage()
        live = self._summaries_files()[0]
        return DiskUsage(
            root=self.where,
            index_bytes=self.index.size_bytes(),
            orphan_files=n,
            orphan_bytes=size,
            summaries_files=len(live),
            summaries_bytes=sum(n for _, n in live),
            **self.index.totals(),
        )


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


def _references(inp: PruneInput) -> dict[str, int]:
    """How many snapshots list each chunk: the member lists, never the stored refcounts, decide."""
    refs = dict.fromkeys(inp.chunks, 0)
    for hashes in inp.members.values():
        for h in hashes:
            refs[h] = refs.get(h, 0) + 1
    return refs


def _plan_prune(
    inp: PruneInput, max_bytes: int | None, cutoff: float | None, keep: frozenset[str]
) -> PruneDecision:
    """Unreferenced chunks first, least recently used first: no snapshot here names them (chunks
    read through from a shared tier, or left by a removal while a restore leased them), so they
    are the cheapest to lose; but the read-through ones spare the next restore a shared-tier read,
    so a budget or a cutoff takes only those it must. A prune with neither takes them all."""
    out = PruneDecision()
    refs = _references(inp)
    total = sum(r.stored_bytes for r in inp.chunks.values())
    loose = [inp.chunks[h] for h, n in refs.items() if n == 0 and h not in inp.leased and h in inp.chunks]
    for row in sorted(loose, key=lambda r: r.last_used):
        too_old = cutoff is not None and row.last_used < cutoff
        too_big = max_bytes is not None and total > max_bytes
        if too_old or too_big or (max_bytes is None and cutoff is None):
            out.chunks.append(row.hash)
            total -= row.stored_bytes
    for s in sorted(inp.snapshots, key=lambda s: (s.last_used, s.created)):
        members = inp.members.get(s.id, [])
        if s.pinned or s.id in keep or any(h in inp.leased for h in members):
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
