"""The KV of earlier turns, reused for a new prompt: a live sequence that the prompt extends, else the
longest chunk-aligned prefix whose chunks live sequences hold (shared, in the pool or the host tier)
or the disk store holds, whichever is longer, else nothing (a cold prefill).

A session keeps its one conversation live between turns; the server keeps as many as it runs at
once, so a client that resends a conversation with one more question reuses it from the GPU, a new
conversation over a document another one holds shares that document's chunks (the pool holds it
once), and any other conversation it has seen (in this process or an earlier one) comes from disk.

Taking a stored prefix is a transaction (docs/DESIGN.md: Scheduler): whatever fails on the way (a damaged or
missing chunk, a full host tier, a full disk, an index error) frees the sequence and its leases
before `take` returns an empty one, with a warning, and the prompt is prefilled cold. The store
counts a hit only for a validated restore: an eager one once its chunks are read, a lazy one (whose
chunks are validated as they are read) when its turn completes (`keep`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvflash.engine.chunk_index import shared_run
from kvflash.engine.engine import Engine
from kvflash.engine.paged_kv import PagedKV
from kvflash.serve.snapshots import KVSnapshots, StoredSummaries
from kvflash.storage import chain_hashes

KEY_MEMO = 8
"""Prompts whose chunk keys `PrefixCache` keeps (`_keys`): admission and `take` ask for one
prompt's keys several times, and conversations over one document share their whole chunks."""


@dataclass(frozen=True)
class Taken:
    """What `PrefixCache.take` gives a turn: its sequence and where the prefix it holds came from
    (`TurnStats.took` copies the rest into the turn's stats)."""

    kv: PagedKV
    source: str = "cold"
    """cold, memory (live in this process), shared (chunks that other live sequences hold), disk, or
    lazy (disk, read on demand)."""
    restored_tokens: int = 0
    shared_host_tokens: int = 0
    """Of a shared prefix, the tokens whose chunks only the host tier held."""
    restore_s: float = 0.0
    """The time a restore from disk took."""


@dataclass
class Made:
    """A sequence this cache made, the lease on the stored chunks it came from (held while a lazy
    one may read them; an eager one's is released once it has read them all), and the chunks whose
    hit it records once its restore is validated."""

    kv: PagedKV
    leases: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    unrecorded: list[str] = field(default_factory=list)


class PrefixCache:
    """Sequences are taken for a turn and kept (idle, live) after it. With a `capacity`, at most that
    many sequences, idle and busy together, hold pool slots (with budgets of pool/capacity the pool
    never runs out); without one, the owner frees idle sequences when it needs their room (`reclaim`)."""

    def __init__(
        self,
        engine: Engine,
        snapshots: KVSnapshots | None,
        budget_tokens: int | None = None,
        lazy: bool | None = None,
        capacity: int | None = 1,
    ):
        self.engine, self.snapshots = engine, snapshots
        self.budget_tokens, self.lazy, self.capacity = budget_tokens, lazy, capacity
        self.idle: list[PagedKV] = []
        """Sequences kept live after their turn, oldest first."""
        self._made: dict[int, Made] = {}
        """Every sequence this cache made and has not freed."""
        self._recent_keys: dict[tuple[int, ...], list[str]] = {}
        """Whole-chunk prompt prefixes -> their chain hashes, least recently asked first."""

    @property
    def latest(self) -> PagedKV | None:
        return self.idle[-1] if self.idle else None

    def take(
        self,
        ids: list[int],
        on_restore: Callable[[int, int], None] | None = None,
        ahead: StoredSummaries | None = None,
        reuse: bool = True,
    ) -> Taken:
        """A sequence holding the longest prefix of ids that is live, shared or stored, leaving at
        least one token to prefill; it is the caller's until `keep` or `drop`. A stored prefix that
        cannot be restored warns and gives an empty sequence (a cold prefill); so does `reuse` False."""
        live, n = self._live(ids) if reuse else (None, 0)
        if live is not None:
            self.idle.remove(live)
            if n < len(live.seq):
                live.truncate(n // self.engine.cfg.residency.chunk_tokens)
            return Taken(live, "memory", len(live.seq))
        kv = self._new()
        taken = Taken(kv)
        try:
            if reuse and kv.share(ids, self._keys(ids), (m.kv for m in self._made.values())):
                host = sum(ch.gpu is None for ch in kv.seq.chunks) * kv.cfg.chunk_tokens
                taken = Taken(kv, "shared", len(kv.seq), host)
        except BaseException:
            self.drop(kv)  # the references it took, released
            raise
        while self.idle and self.capacity is not None and len(self._made) > self.capacity:
            self.drop(self.idle.pop(0))  # after sharing: the chunks it shares outlive it
        whole = (len(ids) - 1) // kv.cfg.chunk_tokens * kv.cfg.chunk_tokens
        if not (reuse and self.snapshots) or len(kv.seq) == whole:
            return taken
        try:
            restored = self._restore(self._made[id(kv)], ids, on_restore, ahead)
        except Exception as e:
            warnings.warn(f"snapshot unusable ({type(e).__name__}: {e}); prefilling cold", stacklevel=2)
            self.drop(kv)
            return Taken(self._new())
        return taken if restored is None else restored

    def continued(self, ids: list[int]) -> PagedKV | None:
        """The idle sequence `take` would continue for ids (left as it is)."""
        return self._live(ids)[0]

    def lendable(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """The pool slots and host slots a new sequence for ids would share (`PagedKV.share`): per
        chunk its pool slot where it is resident, else its host copy."""
        eng, keys = self.engine, self._keys(ids)
        gpu, host = [], []
        for key in keys[: shared_run(keys, eng.pool.index.find, eng.host.find)]:
            g = eng.pool.index.find(key)
            gpu.append(g) if g is not None else host.append(eng.host.find(key))
        return gpu, host

    def reclaim(self, gpu_slots: int, host_slots: int, keep: Collection[PagedKV] = ()) -> None:
        """Makes room for a new turn: until the pool has `gpu_slots` free slots and the host tier
        `host_slots`, idle sequences not in `keep`, oldest first, are parked in the host tier
        where it has room beyond `host_slots` (they stay live, a continuation pages them back), then
        freed (or no other idle sequence is left). One without a whole chunk is freed rather than
        parked: it would keep nothing to reuse and hold no slot, so no later `reclaim` would ever
        free it, and idle sequences would pile up with every short chat."""
        pool, host = self.engine.pool, self.engine.host

        def host_free() -> int:
            return host.max_slots - host.n_used

        def others() -> list[PagedKV]:
            return [kv for kv in self.idle if not any(kv is k for k in keep)]

        for kv in others():
            if pool.n_free >= gpu_slots:
                break
            parked = sum(ch.gpu is not None and ch.host is None for ch in kv.seq.chunks[: kv.seq.n_sealed])
            if not kv.seq.n_sealed:
                self.idle.remove(kv)
                self.drop(kv)
            elif host_free() - parked >= host_slots:
                kv.park()
        for kv in others():
            if pool.n_free >= gpu_slots and host_free() >= host_slots:
                return
            self.idle.remove(kv)
            self.drop(kv)

    def _live(self, ids: list[int]) -> tuple[PagedKV | None, int]:
        """The idle sequence `take` continues for ids, with the tokens of it that ids reuse: one
        that ids extend; else one whose whole chunks before the first difference (a client resent
        the conversation with the answer re-encoded from text, whose ids may differ from the ones
        generated) are more than the named chunks a new sequence would share (approximate KV is
        not named). None otherwise: the idle sequence stays as it is, for its own conversation
        (another conversation over its document, or a resent one), and lends its named chunks."""
        best, n = self._match(ids)
        if best is None or n == len(best.seq):
            return best, n
        eng, c = self.engine, self.engine.cfg.residency.chunk_tokens
        named = shared_run(self._keys(ids)[: n // c], eng.pool.index.find, eng.host.find)
        return (best, n) if n > named * c else (None, 0)

    def _keys(self, ids: list[int]) -> list[str]:
        """The chain hashes of ids' whole chunks before its last token (which is always computed),
        hashed once for the last KEY_MEMO prefixes asked for (not to be changed by the caller)."""
        c = self.engine.cfg.residency.chunk_tokens
        whole = tuple(ids[: (len(ids) - 1) // c * c])
        keys = self._recent_keys.pop(whole, None)
        if keys is None:
            keys = chain_hashes(self.engine.fingerprint, whole, c)
        self._recent_keys[whole] = keys
        if len(self._recent_keys) > KEY_MEMO:
            del self._recent_keys[next(iter(self._recent_keys))]
        return keys

    def _match(self, ids: list[int]) -> tuple[PagedKV | None, int]:
        """The idle sequence sharing the longest reusable prefix with ids, and its length."""
        c = self.engine.cfg.residency.chunk_tokens
        best, best_n = None, 0
        for kv in reversed(self.idle):
            k = min(c, len(kv.seq))
            if kv.seq.tokens[:k] != ids[:k]:  # shares no whole chunk: reuses nothing (skip the scan)
                continue
            n = common_prefix(kv.seq.tokens, ids[: len(ids) - 1])
            if n < len(kv.seq):
                n = min(n // c, kv.seq.n_sealed) * c
            if n > best_n:
                best, best_n = kv, n
        return best, best_n

    def _restore(
        self,
        made: Made,
        ids: list[int],
        on_restore: Callable[[int, int], None] | None,
        ahead: StoredSummaries | None,
    ) -> Taken | None:
        """Restores the longest stored prefix of ids into the made sequence where it is longer than
        what the sequence shares (else None: the sequence stays as it is)."""
        kv = made.kv
        c = self.engine.cfg.residency.chunk_tokens
        fp, hashes, lazy = self._stored(ids)
        if len(hashes) * c <= len(kv.seq):  # the shared prefix is as long
            return None
        kv.truncate(0)  # the store holds more than the pool shares: restore from it instead
        t0 = time.perf_counter()
        r = self.snapshots.restore(kv, fp, hashes, lazy, made.leases, on_restore, ahead=ahead)
        taken = Taken(kv, "lazy" if lazy else "disk", r.tokens, 0, time.perf_counter() - t0)
        made.unrecorded = list(hashes)
        kv.name_restored()
        if not lazy:  # every chunk read and validated: the restore has committed, and needs no lease
            self._record_hit(made)
            self._release(made)
        return taken

    def _stored(self, ids: list[int]) -> tuple[str, list[str], bool]:
        """The longest stored prefix of ids a new sequence (of `engine.new_sequence`'s budget) would
        restore, its fingerprint and chain hashes, and whether lazily: approximate KV counts where
        the sequence evicts anyway."""
        c, budget = self.engine.cfg.residency.chunk_tokens, self.engine.sequence_budget(self.budget_tokens)
        fp, hashes = self.snapshots.lookup(ids, c, approximate=-(-len(ids) // c) > budget)
        return fp, hashes, len(hashes) > budget if self.lazy is None else self.lazy

    def eager_restore_chunks(self, ids: list[int], shared_chunks: int) -> int:
        """Host slots `take` would fill for ids by an eager restore (each restored chunk keeps its
        host copy): the stored prefix's chunks where it is longer than the `shared_chunks` that
        other live sequences lend and would be read eagerly, else 0. Admission reserves them. A store
        that cannot answer now counts none: `take` then finds it so too, and prefills cold. So does
        a restore larger than the whole host tier, which fails at once (HostTierFull): reserved, it
        would hold the queue's head until nothing else ran, only to prefill cold then."""
        if not self.snapshots:
            return 0
        try:
            _, hashes, lazy = self._stored(ids)
        except Exception:
            return 0
        n = len(hashes) if len(hashes) > shared_chunks and not lazy else 0
        return n if n <= self.engine.host.max_slots else 0

    def _record_hit(self, made: Made) -> None:
        """Counts the hit; an index that cannot take it only warns (the answer does not need it)."""
        hashes, made.unrecorded = made.unrecorded, []
        try:
            self.snapshots.store.record_hit(hashes)
        except Exception as e:
            warnings.warn(f"could not record the snapshot's hit: {e}", stacklevel=3)

    def keep(self, kv: PagedKV) -> None:
        """Keeps a sequence live after its turn, for a prompt that extends it. A lazy restore's
        chunks were validated as the turn read them: its hit counts now."""
        made = self._made[id(kv)]
        self.idle.append(kv)
        if made.unrecorded:
            self._record_hit(made)

    def drop(self, kv: PagedKV) -> None:
        """Frees a sequence (its slots and leases); a lease the index cannot release only warns (it
        expires when its heartbeat stops)."""
        made = self._made.pop(id(kv))
        try:
            kv.free()
        finally:
            self._release(made)

    @staticmethod
    def _release(made: Made) -> None:
        try:
            made.leases.close()
        except Exception as e:
            warnings.warn(f"could not release a snapshot lease: {e}", stacklevel=3)

    def close(self) -> None:
        """Frees every sequence this cache made, idle or not."""
        for made in list(self._made.values()):
            self.drop(made.kv)
        self.idle.clear()

    def _new(self) -> PagedKV:
        kv = self.engine.new_sequence(self.budget_tokens)
        self._made[id(kv)] = Made(kv)
        return kv


def common_prefix(a: list[int], b: list[int], block: int = 64) -> int:
    """Length of the longest common prefix of a and b: compared a block at a time, then token by
    token inside the first block that differs (a list slice compares in C; one scan, no copies of
    whole prompts)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + block] == b[i : i + block]:
        i += block
    if i >= n:
        return n
    end = min(i + block, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i
