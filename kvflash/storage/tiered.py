"""Two tiers in one process: a local disk store in front of a shared one on Redis.

Reads go to the local store for every chunk it holds and to the shared one for the rest; chunks read
from the shared tier are copied to the local one in the background once restores have been quiet
(read-through), so the next restore here reads the disk. Saves write the local store, as without a
shared tier, and a background thread copies each new snapshot to the shared tier under the same id,
with the same chunk bytes (write-back), then removes there what the save replaced here. A Redis
that is down or slow costs a warning: lookups and saves go on locally, and the copies wait (within
`writeback_bytes`) until it answers again. The two stores keep their own indexes; a snapshot has
one id in both.

`TieredStore` is one class because its store methods and its copying thread share one state under
one condition: the queue of copies, the chunks read through and the restores reading now.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from kvflash.storage.chunk import ChunkBlob, ChunkSummary
from kvflash.storage.errors import ChunkError, SnapshotNotFound, StoreError
from kvflash.storage.maintenance import PruneReport
from kvflash.storage.records import Snapshot, SnapshotInfo
from kvflash.storage.redis_link import RedisConfig, SharedUnavailable
from kvflash.storage.redis_store import RedisStore
from kvflash.storage.store import SnapshotStore

T = TypeVar("T")
KEEP_RUN = 16
"""Chunks read through that one copy brings here: between copies the thread looks again whether a
restore has started (and then waits for it)."""


@dataclass(frozen=True)
class TierConfig:
    writeback_bytes: int = 8 << 30
    """Stored bytes of snapshots waiting to be copied to the shared tier, at most (Redis down or
    behind); past it the oldest are no longer copied: they stay local."""
    readthrough_bytes: int = 1 << 30
    """Bytes of chunks read from the shared tier and waiting to be copied here, at most; past it a
    chunk is not kept locally (the next restore reads it from Redis again)."""
    readthrough_quiet_s: float = 2.0
    """Read-through copies start once no restore has read for this long: a turn's prefill and first
    token come right after its restore, and the copies would take the cores from them."""
    cache_bytes: int | None = None
    """The local tier's budget: after each copy to the shared tier the local store is pruned to it,
    least recently used first (what goes stays in the shared tier). None: no budget."""
    drain_s: float = 30.0
    """How long closing waits for copies still pending."""


@dataclass
class _Job:
    kind: str
    """copy (a snapshot up, `ids[0]`, taking over the hits of `ids[1:]`), rm (`ids[0]`), hit."""
    ids: list[str] = field(default_factory=list)
    nbytes: int = 0


class TieredStore:
    """The store methods that sessions and the server call (kvflash/serve/snapshots.py), over two tiers."""

    def __init__(self, local: SnapshotStore, shared: RedisStore, cfg: TierConfig = TierConfig()):
        self.local, self.shared, self.cfg = local, shared, cfg
        self.where = f"{local.where} in front of {shared.where}"
        self.read_only = local.read_only
        self._jobs: deque[_Job] = deque()
        self._spared: set[str] = set()
        """Snapshots whose replacing copy was dropped for the write-back budget: kept shared."""
        self._local_only: set[str] = set()
        """Snapshots whose copy was dropped (the write-back budget) or failed: the local tier's
        budget never removes them, or they would be in neither tier."""
        self._pending = 0
        self._fetched: dict[str, int] = {}
        """Chunks read from the shared tier, to be copied here (their sizes)."""
        self._fetched_bytes = 0
        self._reading = 0
        """Restores reading chunks now."""
        self._leased_shared: Counter[str] = Counter()
        """Chunks leased in the shared tier by restores here: their reads stay there while the lease
        lasts, though a read-through copy may reach the local tier meanwhile (no lease holds it)."""
        self._last_read = 0.0
        self._cond = threading.Condition()
        self._placing = threading.Lock()
        """Held by a save from bringing its chunks here to queueing its copy, and by the local
        tier's prune: between the two, the prune would see chunks that no snapshot names yet, or a
        snapshot that no copy job names yet."""
        self._closing = False
        shared.reader.fetched = self._keep
        self._worker = threading.Thread(target=self._run, name="kvflash-tiers", daemon=True)
        self._worker.start()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Waits up to `drain_s` for the copies pending (none while Redis is down), then closes both."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._worker.join(self.cfg.drain_s)
        with self._cond:
            if left := sum(j.kind == "copy" for j in self._jobs):
                warnings.warn(f"{left} snapshots were not copied to {self.shared.where}", stacklevel=2)
            self._jobs.clear()
            self._fetched.clear()
            self._cond.notify_all()
        self._worker.join()
        self.shared.close()
        self.local.close()

    def _try(self, fn: Callable[[], T], default: T) -> T:
        """fn() on the shared tier; a tier that cannot answer gives `default` (it has warned once)."""
        try:
            return fn()
        except SharedUnavailable:
            return default
        except StoreError as e:
            warnings.warn(f"the shared store: {e}", stacklevel=3)
            return default

    # lookups and restores

    def find_longest_prefix(self, fingerprint: str, chain_hashes: Sequence[str]) -> int:
        n = self.local.find_longest_prefix(fingerprint, chain_hashes)
        if n == len(chain_hashes):
            return n
        return max(n, self._try(lambda: self.shared.find_longest_prefix(fingerprint, chain_hashes), 0))

    def _here(self, hashes: Sequence[str]) -> set[str]:
        """The chunks the local tier holds intact (by its index)."""
        return {h for h, r in self.local.index.chunk_rows(hashes).items() if not r.damaged}

    def _by_tier(self, hashes: Sequence[str], read: Callable[[SnapshotStore, list[int]], list[T]]) -> list[T]:
        """read(tier, positions) for the positions each tier serves, merged back in order: the local
        tier those it holds, but a chunk leased in the shared tier is read there (`lease`)."""
        here = self._here(hashes)
        with self._cond:
            leased = {h for h in here if self._leased_shared[h]}
        served = here - leased
        local = [i for i, h in enumerate(hashes) if h in served]
        shared = [i for i, h in enumerate(hashes) if h not in served]
        got: dict[int, T] = {}
        if local:
            got.update(zip(local, read(self.local, local), strict=True))
        if shared:
            try:
                got.update(zip(shared, read(self.shared, shared), strict=True))
            except SharedUnavailable:
                if not all(hashes[i] in leased for i in shared):
                    raise
                got.update(zip(shared, read(self.local, shared), strict=True))  # copies here, unleased
        return [got[i] for i in range(len(hashes))]

    def read_chunks_parallel(
        self,
        hashes: Sequence[str],
        expect_fingerprint: str,
        expect_shape: Sequence[int] | None = None,
        expect_dtype: torch.dtype | None = None,
        out: Sequence[torch.Tensor] | None = None,
        with_summary: bool = True,
    ) -> list[ChunkBlob]:
        def read(tier: SnapshotStore, at: list[int]) -> list[ChunkBlob]:
            outs = None if out is None else [out[i] for i in at]
            return tier.read_chunks_parallel(
                [hashes[i] for i in at], expect_fingerprint, expect_shape, expect_dtype, outs, with_summary
            )

        with self._cond:
            self._reading += 1
        try:
            return self._by_tier(hashes, read)
        finally:
            with self._cond:
                self._reading -= 1
                self._last_read = time.monotonic()
                self._cond.notify_all()

    def read_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        """From one summaries file, the local tier's else the shared one's (a chain read through from
        the shared tier has its chunks here but its snapshot, and so its file, there); else per chunk
        from the tier that serves each."""
        got = self.local.chain_summaries(hashes, expect_fingerprint, out)
        if got is None:
            got = self._try(lambda: self.shared.chain_summaries(hashes, expect_fingerprint, out), None)
        if got is not None:
            return got

        def read(tier: SnapshotStore, at: list[int]) -> list[ChunkSummary]:
            part = None if out is None else torch.empty((len(at), *out.shape[1:]))
            got = tier.chunk_summaries([hashes[i] for i in at], expect_fingerprint, part)
            if out is not None:
                out[at] = part
            return got

        return self._by_tier(hashes, read)

    @contextmanager
    def lease(self, hashes: Sequence[str]) -> Iterator[None]:
        """Each tier leases the chunks it serves: a prune on any server spares them. A chunk leased
        in the shared tier is read there until the lease ends, even once read through to the local
        tier, where no lease holds it."""
        here = self._here(hashes)
        with ExitStack() as stack:
            if local := [h for h in hashes if h in here]:
                stack.enter_context(self.local.lease(local))
            if shared := [h for h in hashes if h not in here]:
                stack.enter_context(self.shared.lease(shared))
                with self._cond:
                    self._leased_shared.update(shared)
                stack.callback(self._unlease_shared, shared)
            yield

    def _unlease_shared(self, hashes: list[str]) -> None:
        with self._cond:
            self._leased_shared.subtract(hashes)
            self._leased_shared = +self._leased_shared  # drops the counts at zero

    def record_hit(self, hashes: Sequence[str]) -> None:
        self.local.record_hit(hashes)
        self._queue(_Job("hit", list(hashes)))

    # snapshots

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        try:
            return self.local.get_snapshot(snapshot_id)
        except SnapshotNotFound:
            try:
                return self.shared.get_snapshot(snapshot_id)
            except SharedUnavailable:
                why = f"no snapshot {snapshot_id} here, and the shared store is unreachable"
                raise SnapshotNotFound(why) from None

    def list_snapshots(self) -> list[SnapshotInfo]:
        """Both tiers' snapshots, one entry per id (the shared tier's, whose hits count every server)."""
        by_id = {s.id: s for s in self.local.list_snapshots()}
        by_id.update({s.id: s for s in self._try(self.shared.list_snapshots, [])})
        return sorted(by_id.values(), key=lambda s: s.created)

    def put_snapshot(
        self,
        label: str,
        fingerprint: str,
        chunks: Iterable[ChunkBlob | str],
        meta: dict | None = None,
        succeeds: Sequence[str] = (),
        known: Sequence[ChunkSummary] = (),
    ) -> str:
        """Saves to the local tier and queues the copy to the shared one. A chunk given by hash that
        only the shared tier holds is brought here first (from the read-through queue, else Redis)."""
        items = list(chunks)
        with self._placing:
            self._bring_here([x for x in items if isinstance(x, str)])
            sid = self.local.put_snapshot(label, fingerprint, items, meta, succeeds, known)
            self._queue(_Job("copy", [sid, *succeeds], self.local.get_snapshot(sid).stored_bytes))
        return sid

    def yield_saves_to(self, quiet: threading.Event, max_wait_s: float) -> None:
        """Saves encode in the local tier (the shared one copies their files)."""
        self.local.yield_saves_to(quiet, max_wait_s)

    def rm(self, snapshot_id: str) -> PruneReport:
        """Removes it here now, and from the shared tier after the copies queued before it, unless
        the copy of the snapshot that replaced it was dropped (the shared tier has nothing newer)."""
        with self._cond:
            spared = snapshot_id in self._spared
            self._spared.discard(snapshot_id)
            self._local_only.discard(snapshot_id)
        if not spared:
            self._queue(_Job("rm", [snapshot_id]))
        try:
            return self.local.rm(snapshot_id)
        except SnapshotNotFound:
            return PruneReport(False, [], 0, 0, 0, 0)

    def _bring_here(self, hashes: list[str]) -> None:
        here = self._here(hashes)
        missing = [h for h in hashes if h not in here]
        if not missing:
            return
        with self._cond:
            self._fetched_bytes -= sum(self._fetched.pop(h, 0) for h in missing)
        self._copy_down(missing)

    def _copy_down(self, hashes: list[str]) -> None:
        """The chunks' files from the shared tier to the local one, one file in memory at a time."""
        self.local.copy_in((h, self.shared.chunk_file(h)) for h in hashes)

    # the background thread

    def _keep(self, chunk_hash: str, size: int) -> None:
        """Read-through: a chunk verified on its way from the shared tier is queued to be copied
        here. Only its name: the restore's threads read into buffers they reuse, and a copy of
        every chunk's bytes kept for later cost them a fresh chunk-sized buffer each; the copy
        reads it from the shared tier again once no restore is reading."""
        with self._cond:
            if self._closing or self._fetched_bytes + size > self.cfg.readthrough_bytes:
                return
            if chunk_hash not in self._fetched:
                self._fetched[chunk_hash] = size
                self._fetched_bytes += size
                self._cond.notify_all()

    def _queue(self, job: _Job) -> None:
        with self._cond:
            self._jobs.append(job)
            self._pending += job.nbytes
            while self._pending > self.cfg.writeback_bytes:
                old = next((j for j in list(self._jobs)[1:] if j.nbytes), None)  # [0] is being copied
                if old is None:
                    break
                self._jobs.remove(old)
                self._pending -= old.nbytes
                if old.kind == "copy":
                    warnings.warn(
                        f"the shared store is behind: snapshot {old.ids[0]} stays local", stacklevel=3
                    )
                    self._local_only.add(old.ids[0])
                    # the snapshots it replaced stay shared: the shared tier gets nothing newer
                    self._spared.update(old.ids[1:])
                    spared = self._spared
                    self._jobs = deque(j for j in self._jobs if not (j.kind == "rm" and j.ids[0] in spared))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or self._keep_now() or self._closing):
                    self._cond.wait(self._quiet_left() if self._fetched and not self._reading else None)
                if self._keep_now():
                    run = [self._fetched.popitem() for _ in range(min(KEEP_RUN, len(self._fetched)))]
                    self._fetched_bytes -= sum(size for _, size in run)
                    job = None
                elif self._jobs:
                    job = self._jobs[0]
                else:
                    return
            if job is None:
                self._keep_here([h for h, _ in run])
                continue
            copied = True
            try:
                self._do(job)
            except SharedUnavailable:
                with self._cond:
                    if self._closing:
                        return
                    self._cond.wait(self.shared.cfg.retry_s)
                continue
            except Exception as e:  # on this thread nobody else would hear of it
                warnings.warn(f"could not update the shared store: {e}", stacklevel=2)
                copied = False
            with self._cond:
                if self._jobs and self._jobs[0] is job:
                    self._jobs.popleft()
                    self._pending -= job.nbytes
                if job.kind == "copy" and not copied:
                    self._local_only.add(job.ids[0])
            if job.kind == "copy" and copied and self.cfg.cache_bytes is not None:
                self._fit_cache()

    def _quiet_left(self) -> float:
        return self._last_read + self.cfg.readthrough_quiet_s - time.monotonic()

    def _keep_now(self) -> bool:
        """Chunks read through wait while a restore reads, and `readthrough_quiet_s` after: copying
        them takes the cores and the disk that the restore and its turn need, and the next restore
        here is what they are for."""
        return bool(self._fetched) and not self._reading and self._quiet_left() <= 0

    def _keep_here(self, hashes: list[str]) -> None:
        here = self._here(hashes)
        if not (missing := [h for h in hashes if h not in here]):
            return
        try:
            self._copy_down(missing)
        except (SharedUnavailable, ChunkError):
            pass  # unreachable (warned), or evicted since: the next restore reads the shared tier
        except Exception as e:
            warnings.warn(f"could not keep chunks read from the shared store locally: {e}", stacklevel=2)

    def _do(self, job: _Job) -> None:
        if job.kind == "hit":
            self.shared.record_hit(job.ids)
        elif job.kind == "rm":
            try:
                self.shared.rm(job.ids[0])
            except SnapshotNotFound:
                pass
        else:
            self._copy_up(job.ids[0], job.ids[1:])

    def _copy_up(self, snapshot_id: str, succeeds: list[str]) -> None:
        """The snapshot and the chunk files the shared tier lacks, one file in memory at a time, and
        its summaries file unless the shared tier has one."""
        try:
            snap = self.local.get_snapshot(snapshot_id)
        except SnapshotNotFound:
            return  # replaced or pruned here before its turn came
        hashes = list(snap.chunk_hashes)
        rows = self.shared.index.chunk_rows(hashes)
        there = self.shared.backend.exists_all(hashes)
        missing = [
            h for h, ok in zip(hashes, there, strict=True) if not ok or h not in rows or rows[h].damaged
        ]
        summaries = None
        if not self.shared.has_summaries(snap.fingerprint, hashes):
            try:
                summaries = self.local.summaries_file(snap.fingerprint, hashes)
            except ChunkError:
                pass  # none intact here: its restores from the shared tier read per chunk
        files = ((h, self.local.chunk_file(h)) for h in missing)
        self.shared.copy_in(files, snap, succeeds, summaries)

    def _fit_cache(self) -> None:
        """The local tier pruned to its budget once a copy is done, sparing the snapshots whose
        copies are still queued, were dropped or failed: removed here, they would be in neither tier."""
        with self._placing:
            with self._cond:
                keep = {j.ids[0] for j in self._jobs if j.kind == "copy"} | self._local_only
            try:
                self.local.prune(max_bytes=self.cfg.cache_bytes, keep=keep)
            except Exception as e:  # on this thread nobody else would hear of it
                warnings.warn(f"could not prune {self.local.where} to its budget: {e}", stacklevel=2)


SERVER_SAVE_THREADS = 2
"""Chunks a server's save encodes at once. A server saves after each answer, in the background,
while its scheduler runs the other requests' steps on the same interpreter: every store thread that
encodes takes a share of the GIL from the scheduler, whose launches wait for it (docs/BENCHMARKS.md:
Serving many conversations), and no user waits for a save."""


def open_tiers(
    store: Path | None, shared: str | None, processes: int = 0, cfg: TierConfig = TierConfig()
) -> SnapshotStore | RedisStore | TieredStore:
    """The store a server runs on: a directory, a Redis URL, or both (the directory in front). A
    Redis that does not answer yet warns and is tried again later; a wrong password or URL raises.
    Its saves encode SERVER_SAVE_THREADS chunks at once."""
    from kvflash.paths import snapshots_dir

    if shared is None:
        return SnapshotStore(store or snapshots_dir(), processes=processes, save_threads=SERVER_SAVE_THREADS)
    remote = RedisStore(RedisConfig(shared), check=False)
    try:
        remote.link.call(lambda c: c.ping())
    except SharedUnavailable:
        pass  # warned; every call tries again after the link's retry time
    except BaseException:
        remote.close()
        raise
    if store is None:
        return remote
    try:
        return TieredStore(
            SnapshotStore(store, processes=processes, save_threads=SERVER_SAVE_THREADS), remote, cfg
        )
    except BaseException:
        remote.close()
        raise
