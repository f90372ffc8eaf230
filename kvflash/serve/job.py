"""One request as the scheduler runs it: its prompt, how to answer, its callbacks and its state."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvflash.engine.generate import Generation, Sampling
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.step import Prefill
from kvflash.serve.admission import Room
from kvflash.serve.turn import TurnStats

_serials = itertools.count()


@dataclass
class Job:
    """One request: its prompt ids and how to answer; the callbacks run on the scheduler's thread."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    on_token: Callable[[int], bool]
    """Each generated id as it comes; True ends the answer (a stop string)."""
    on_done: Callable[[list[int], TurnStats, PagedKV], None]
    """The answer's ids and stats, with its sequence (kept live by then, to snapshot)."""
    on_error: Callable[[BaseException], None]
    gone: threading.Event = field(default_factory=threading.Event)
    """Set when the client has left: the request ends at its next prefill piece or token."""
    stats: TurnStats = field(default_factory=TurnStats)
    t0: float = field(default_factory=time.perf_counter)
    kv: PagedKV | None = None
    prefill: Prefill | None = None
    """Its prefill, a piece per step."""
    gen: Generation | None = None
    next: int = 0
    """The token to feed at the next step."""
    ended: BaseException | bool = False
    """Its answer ended at the token handed over while its next step ran (`Scheduler._send`): by
    `on_token` (True) or by what `on_token` raised. That step's token is not the answer's."""
    recoveries: int = 0
    min_tokens: int = 0
    """Stop ids are not sampled before this many tokens."""
    pins: tuple[tuple[int, int], ...] = ()
    """Token ranges [lo, hi) of its prompt whose chunks stay resident while it runs."""
    timeout_s: float | None = None
    """From t0: a request still waiting or prefilling then fails (`TimedOut`); one answering ends
    its answer there."""
    timed_out: bool = False
    """Its answer ended at `timeout_s`."""
    need: Room | None = None
    """The slots it reserved when it was admitted."""
    restore_chunks: int | None = None
    """Host slots an eager restore of its stored prefix would fill (`PrefixCache.eager_restore_chunks`),
    once admission has looked."""
    taken_chunks: int = 0
    """Whole chunks of the live sequence it continued or shared, which earlier turns computed: what
    it gives back if it ends before its first token."""
    serial: int = field(default_factory=lambda: next(_serials))
    """Names the job in other jobs' `common_chunks` (a dataclass compared by fields has no hash)."""
    common_chunks: dict[int, int] = field(default_factory=dict)
    """Whole chunks its prompt has in common with a busy job's, by that job's serial: prompts do not
    change, and a job held back by another's prefill is looked at every round
    (`Scheduler._shares_busy_prefix`)."""

    def expired(self) -> bool:
        return self.timeout_s is not None and time.perf_counter() - self.t0 > self.timeout_s

    @property
    def context(self) -> list[int]:
        """The ids its sequence must hold before its next step: the prompt and the answer so far."""
        return self.ids + (self.gen.out if self.gen else [])
