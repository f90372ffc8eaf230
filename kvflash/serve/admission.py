"""What a request reserves when it is admitted, and what the others hold: the scheduler admits a
request when its reservation fits beside the running requests' (kvflash/serve/scheduler.py).

Slots are counted in the GPU pool and in the host tier; a slot that several sequences read (a
shared document's chunk) is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflash.engine.paged_kv import PagedKV


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


@dataclass
class Holdings:
    """The slots some sequences hold, a slot several of them read counted once: slots that more than
    one sequence reads are kept in sets, the others just counted."""

    sole: Room = Room(0, 0)
    """Slots no other sequence reads."""
    gpu: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)

    def add(self, kv: PagedKV | None) -> None:
        if kv is not None:
            g = [ch.gpu for ch in kv.seq.chunks if ch.gpu is not None]
            h = [ch.host for ch in kv.seq.chunks if ch.host is not None]
            shared_g, shared_h = [s for s in g if kv.pool.refs(s) > 1], [s for s in h if kv.host.refs(s) > 1]
            self.sole += Room(len(g) - len(shared_g), len(h) - len(shared_h))
            self.gpu.update(shared_g)
            self.host.update(shared_h)

    def beyond(self, *others: Holdings) -> Room:
        """The slots held here and in none of `others`: what freeing these sequences frees."""
        gpu, host = set(self.gpu), set(self.host)
        for o in others:
            gpu -= o.gpu
            host -= o.host
        return self.sole + Room(len(gpu), len(host))


def owed(need: Room, kv: PagedKV | None, lent: tuple[list[int], list[int]] = ([], [])) -> Room:
    """The most slots a job may still take from the free ones: its reservation less the slots it
    holds (and those it is about to share, `lent`). A job that evicts may also give up a pool slot it
    shares, which its other readers keep, and page the chunk back into a new one: one more each."""
    g = [ch.gpu for ch in kv.seq.chunks if ch.gpu is not None] if kv is not None else []
    h = sum(ch.host is not None for ch in kv.seq.chunks) if kv is not None else 0
    shared = len(lent[0]) + (sum(kv.pool.refs(s) > 1 for s in g) if kv is not None else 0)
    has = Room(len(g) + len(lent[0]), h + len(lent[1]))
    evicts = need.host > 0
    return Room(max(0, need.gpu - has.gpu) + (shared if evicts else 0), max(0, need.host - has.host))


def holds_any(kv: PagedKV, gpu: set[int], host: set[int]) -> bool:
    """Whether a sequence holds any of these slots."""
    return any(ch.gpu in gpu or ch.host in host for ch in kv.seq.chunks)
