"""What a request reserves when it is admitted, and what the others hold: the scheduler admits a
request when its reservation fits beside the running requests' (kvflash/serve/scheduler.py).

Slots are counted in the GPU pool and in the host tier; a slot that several sequences read (a
shared document's chunk) is counted once.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflash.engine.host_tier import HostTier
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import ChunkPool


@dataclass(frozen=True)
class Room:
    """Slots of the pool and of the host tier."""

    gpu: int
    host: int

    def __sub__(self, other: Room) -> Room:
        return Room(self.gpu - other.gpu, self.host - other.host)

    def __add__(self, other: Room) -> Room:
        return Room(self.gpu + other.gpu, self.host + other.host)

    def covers(self, other: Room) -> bool:
        return self.gpu >= other.gpu and self.host >= other.host


@dataclass(frozen=True)
class Held:
    """One sequence's slots: its pool slots and host slots, and of those the ones something else
    reads too (another sequence, a staged snapshot)."""

    gpu: frozenset[int]
    host: frozenset[int]
    shared_gpu: frozenset[int]
    shared_host: frozenset[int]

    @classmethod
    def of(cls, kv: PagedKV) -> Held:
        gpu = frozenset(ch.gpu for ch in kv.seq.chunks if ch.gpu is not None)
        host = frozenset(ch.host for ch in kv.seq.chunks if ch.host is not None)
        pool, tier = kv.pool, kv.host
        return cls(
            gpu,
            host,
            frozenset(s for s in gpu if pool.refs(s) > 1),
            frozenset(s for s in host if tier.refs(s) > 1),
        )

    def holds_any(self, gpu: set[int], host: set[int]) -> bool:
        """Whether any of these slots is among its own."""
        return not (self.gpu.isdisjoint(gpu) and self.host.isdisjoint(host))


class HeldCache:
    """`Held.of` each sequence, computed again only once its own chunks gained or lost a slot (its
    pager's `version`) or a slot started or stopped being shared (the pool's and the host tier's
    `epoch`s): admitting requests one after another beside the busy and idle sequences would
    otherwise walk every chunk of every sequence for each request, a cost that grows with the
    square of the requests that arrive together. One thread's (the scheduler's). It holds the
    sequences weakly: a sequence freed since keeps no memory alive here."""

    def __init__(self, pool: ChunkPool, host: HostTier):
        self.pool, self.host = pool, host
        self._epochs = (-1, -1)
        self._memo: dict[int, tuple[weakref.ref[PagedKV], int, Held]] = {}

    def __call__(self, kv: PagedKV | None) -> Held | None:
        if kv is None:
            return None
        epochs = self.pool.epoch, self.host.epoch
        if epochs != self._epochs:
            self._memo.clear()
            self._epochs = epochs
        version = kv.pager.version  # read before the walk: a move during it is seen next time
        hit = self._memo.get(id(kv))
        if hit is not None and hit[0]() is kv and hit[1] == version:
            return hit[2]
        held = Held.of(kv)
        self._memo[id(kv)] = weakref.ref(kv), version, held
        return held


@dataclass
class Holdings:
    """The slots some sequences hold, a slot several of them read counted once: slots that something
    else reads too are kept with how many of these sequences read them, the others just counted."""

    sole: Room = Room(0, 0)
    """Slots nothing else reads."""
    gpu: Counter[int] = field(default_factory=Counter)
    host: Counter[int] = field(default_factory=Counter)

    def add(self, held: Held | None) -> None:
        if held is not None:
            self.sole += Room(len(held.gpu) - len(held.shared_gpu), len(held.host) - len(held.shared_host))
            self.gpu.update(held.shared_gpu)
            self.host.update(held.shared_host)

    def beyond(self, *others: Holdings, host_refs: Callable[[int], int] | None = None) -> Room:
        """The slots held here and in none of `others`: what freeing these sequences frees. With
        `host_refs` (a host slot's readers), a host slot read by more than these sequences (a
        staged snapshot's copy) is not counted: freeing them would not free it."""
        gpu = set(self.gpu)
        host = {h for h, n in self.host.items() if host_refs is None or n >= host_refs(h)}
        for o in others:
            gpu -= o.gpu.keys()
            host -= o.host.keys()
        return self.sole + Room(len(gpu), len(host))


def owed(need: Room, held: Held | None, lent: tuple[list[int], list[int]] = ([], [])) -> Room:
    """The most slots a job may still take from the free ones: its reservation less the slots it
    holds (`held`, and those it is about to share, `lent`). A job that evicts may also give up a pool
    slot it shares, which its other readers keep, and page the chunk back into a new one: one more
    each."""
    g, h = (len(held.gpu), len(held.host)) if held is not None else (0, 0)
    shared = len(lent[0]) + (len(held.shared_gpu) if held is not None else 0)
    has = Room(g + len(lent[0]), h + len(lent[1]))
    evicts = need.host > 0
    return Room(max(0, need.gpu - has.gpu) + (shared if evicts else 0), max(0, need.host - has.host))
