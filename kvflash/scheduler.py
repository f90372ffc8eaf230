"""Continuous batching: the requests of a server decode together, one token each per forward.

One thread owns the engine. It admits waiting requests while fewer than `max_batch` run: each takes a
sequence from the prefix cache (live, restored from disk, or empty) and prefills the rest of its
prompt, one piece (`prefill_step_tokens`) per round, so the running requests go on decoding between
the pieces; one request prefills at a time. Each round, every running request advances one token in
one batched forward (`Engine.decode_batch`). A request ends at a stop id, at max_tokens or when its
consumer says so; its sequence goes back to the prefix cache, live. Each sequence's budget is the
pool divided by `max_batch`, and the prefix cache holds at most `max_batch` sequences, so the pool
never runs out.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from kvflash import KVFlashError
from kvflash.engine import Engine
from kvflash.generate import Sampler, Sampling
from kvflash.paged_kv import PagedKV
from kvflash.prefix_cache import PrefixCache
from kvflash.snapshots import KVSnapshots
from kvflash.turn import Generation, TurnStats

FILLING, DECODING, ENDED = range(3)
"""Where a job stands after a round of its prefill (`Scheduler._fill`)."""


@dataclass
class Job:
    """One request: its prompt ids and how to answer; the callbacks run on the scheduler's thread."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    on_token: Callable[[int], bool]
    """Each generated id as it comes; True ends the answer (a stop string, a client gone)."""
    on_done: Callable[[list[int], TurnStats, PagedKV], None]
    """The answer's ids and stats, with its sequence (kept live by then, to snapshot)."""
    on_error: Callable[[BaseException], None]
    stats: TurnStats = field(default_factory=TurnStats)
    t0: float = field(default_factory=time.perf_counter)
    kv: PagedKV | None = None
    pieces: Generator[None, None, torch.Tensor] | None = None
    """Its prefill, a piece per round (`Engine.prefill_pieces`)."""
    gen: Generation | None = None
    next: int = 0
    """The token to feed at the next step."""


class Scheduler:
    def __init__(
        self, engine: Engine, snapshots: KVSnapshots | None, stop_ids: frozenset[int], max_batch: int = 4
    ):
        self.engine, self.stop_ids, self.max_batch = engine, stop_ids, max_batch
        res = engine.cfg.residency
        chunks = engine.pool.n_slots // max_batch
        if chunks < res.floor_chunks():
            raise KVFlashError(
                f"a pool of {engine.pool.n_slots} chunks gives each of max_batch {max_batch} requests "
                f"{chunks} chunks, below the floor of {res.floor_chunks()}: a larger pool or a smaller batch"
            )
        budget = chunks * res.chunk_tokens
        self.cache = PrefixCache(engine, snapshots, budget_tokens=budget, capacity=max_batch)
        self.steps = 0
        """Batched forwards run."""
        self.batched = 0
        """Tokens they decoded: batched / steps is the mean batch."""
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvflash-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        """Answers what was submitted, then stops and frees every sequence."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        running: list[Job] = []
        filling: Job | None = None
        closing = False
        while running or filling or not closing:
            if filling is None and not closing and len(running) < self.max_batch:
                try:  # waits only when there is nothing else to do
                    job = self._queue.get(block=not running)
                except queue.Empty:
                    pass
                else:
                    if job is None:
                        closing = True
                    elif self._start(job):
                        filling = job
            if filling is not None:
                state = self._fill(filling)
                if state != FILLING:
                    if state == DECODING:
                        running.append(filling)
                    filling = None
            if running:
                running = self._step(running)
        self.cache.close()

    def _start(self, job: Job) -> bool:
        """Takes a sequence for the job and sets up its prefill; False if that failed."""
        try:
            job.kv = self.cache.take(job.ids, job.stats)
            rest = job.ids[len(job.kv.seq) :]
            job.stats.prefilled_tokens = len(rest)
            job.pieces = self.engine.prefill_pieces(job.kv, rest)
            return True
        except Exception as e:
            self._fail(job, e)
            return False

    def _fill(self, job: Job) -> int:
        """Runs one piece of the job's prefill: FILLING while pieces remain. After the last the first
        token is sampled: DECODING, or ENDED (the answer ended there, or the job failed)."""
        try:
            next(job.pieces)
            return FILLING
        except StopIteration as last:
            logits = last.value
        except Exception as e:
            self._fail(job, e)
            return ENDED
        sampler = Sampler(job.sampling, self.engine.lm.device)
        job.gen = Generation(job.max_tokens, sampler, self.stop_ids, job.stats, job.t0, job.on_token)
        return DECODING if self._advance(job, logits) else ENDED

    def _step(self, running: list[Job]) -> list[Job]:
        try:
            logits = self.engine.decode_batch([j.kv for j in running], [j.next for j in running])
            argmax = logits.argmax(-1).tolist()  # every greedy job's token in one read back
        except Exception as e:  # one forward for all: all of them fail
            for job in running:
                self._fail(job, e)
            return []
        self.steps += 1
        self.batched += len(running)
        rows = zip(running, logits, argmax, strict=True)
        return [j for j, row, top in rows if self._advance(j, row, top)]

    def _advance(self, job: Job, logits: torch.Tensor, argmax: int | None = None) -> bool:
        """Samples the job's next token (a greedy job takes `argmax` where given); whether it goes on.
        Nothing a job's callbacks raise may end this thread: every other request waits on it."""
        try:
            sampler = job.gen.sampler
            tok = job.gen.push(argmax if argmax is not None and sampler.greedy else sampler(logits))
        except Exception as e:
            self._fail(job, e)
            return False
        if tok is not None:
            job.next = tok
            return True
        out = job.gen.finish(job.kv)
        self.cache.keep(job.kv)  # before on_done: whoever hears of the answer finds it live
        try:
            job.on_done(out, job.stats, job.kv)
        except Exception as e:  # the answer is out; its consumer's trouble is not the engine's
            warnings.warn(f"request callback failed: {e}", stacklevel=2)
        return False

    def _fail(self, job: Job, e: BaseException) -> None:
        if job.kv is not None:
            self.cache.drop(job.kv)
            job.kv = None
        try:
            job.on_error(e)
        except Exception as again:
            warnings.warn(f"request error callback failed: {again} (on {e})", stacklevel=2)
