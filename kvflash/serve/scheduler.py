"""Continuous batching: the requests of a server advance together, a step at a time, in one forward.

One thread owns the engine. It admits waiting requests in the order they came while the pool has
room for them and fewer than `max_batch` run: each takes a sequence from the prefix cache (live,
sharing another's chunks, restored from disk, or empty) and prefills the rest of its prompt in
pieces. A step is a token budget (`Engine.step_tokens`): one decode token of every running request,
then the next pieces of the prefilling ones in the order they came, as many as fit, all in one
forward (`Engine.forward`, chunked prefill mixed with decode): a long prompt never stalls the
others' answers, and the short next turns of many conversations prefill in one step. A request whose
prompt has whole chunks in common with a prefilling one's (one document, several conversations)
waits until that prefill has sealed them, then shares them in the pool (`PrefixCache`): the pool
holds them once. A step of decode tokens alone replays CUDA graphs. A request ends at a stop id, at
max_tokens or when its consumer says so; its sequence goes back to the prefix cache, live. A step's
tokens are handed to their consumers (streaming, stop strings) while the next step runs on the
device; greedy decode steps leave their tokens there for the next step (`Ahead`), which is launched
before the host reads them back. An answer that ends at a token seen only then (its consumer ends
it, a stop id) runs that one step more, whose token is dropped.

Admission by room: every sequence has one budget (`sequence_tokens`, at most the pool), and a
request reserves the pool slots its prompt and answer can fill, up to that budget (and, when it will
evict, host-tier slots for its chunks). It is admitted when its reservation fits beside the
reservations of the requests running, once idle live sequences (oldest first, never the one it
continues or shares chunks from) are parked in the host tier or freed for it; else it waits at the
head of the queue, so a long prompt is not overtaken forever by short ones. Thirty short chats thus
run together in a pool that one long document fills alone, and the pool never runs out under a
running request.

Isolation: whatever a request's admission, prefill piece, sampling or callbacks raise fails that
request alone. A step that raises is run again part by part (the decode tokens together, then each
alone; each piece alone), so only the requests that fail alone fail. A lazily restored chunk found
damaged when it is read sends its request back to prefill what it has (prompt and answer so far)
from the valid stored prefix, then cold, instead of failing it. Should the loop itself ever fail,
every request it holds and every later one gets `SchedulerDown` at once: nothing waits on a thread
that is gone.

`Scheduler` is one class of some 400 lines, and this module holds little else, because admission,
the step and isolation read and change one state (the queue, the running requests, their
reservations) that only its thread touches: split apart, each part would take that whole state as
arguments. A request is a `Job` (kvflash/serve/job.py); what it reserves, `admission.py`.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflash import KVFlashError
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler
from kvflash.engine.step import Piece
from kvflash.serve.admission import HeldCache, Holdings, Room, owed
from kvflash.serve.ahead import Ahead, Readback
from kvflash.serve.job import Job
from kvflash.serve.prefix_cache import PrefixCache, common_prefix
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import ChunkError

RECOVERIES = 2
"""Re-prefills a request gets after damaged lazy chunks: the first from the valid stored prefix (the
store marks a damaged chunk when it reads one), the second into a new sequence, reading nothing."""


@dataclass(frozen=True)
class StepTime:
    """One step's time on the scheduler's thread (`Scheduler.on_step`): whether the host or the
    device sets the pace of the steps is their difference."""

    kind: str
    """decode (decode tokens alone), mixed (decode tokens and prefill pieces) or prefill (pieces)."""
    seconds: float
    """From the step's planning to its tokens handed on: what one step costs the running answers."""
    waited: float
    """Of it, the thread's wait for the device to give back the step's tokens (the decode tokens of
    this step or, ahead, the one before; the greedy first tokens of its pieces): the host's share
    is the rest."""


class SchedulerDown(KVFlashError):
    """The scheduler's thread has stopped: the server cannot answer."""


class Cancelled(KVFlashError):
    """The request ended before its first token: its client left, or the server is stopping."""


class TimedOut(KVFlashError):
    """The request reached its time limit before its first token (or, sent back to prefill after a
    damaged stored chunk, before its next one)."""


_WAKE = object()
"""Queued by `Scheduler.call` after its function: a loop waiting for work wakes to run it."""
SWEEP_S = 0.05
"""How often the loop looks for waiting requests whose client left or whose time is up."""

MAX_SEQUENCE_TOKENS = 262_144
"""The default budget of a sequence when the pool is larger: a sequence's decode buffers and every
batch's stacked slot tables are as wide as its budget, so the budget of a whole large pool would cost
device memory per batch row that no sequence uses."""


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        snapshots: KVSnapshots | None,
        stop_ids: frozenset[int],
        max_batch: int = 32,
        sequence_tokens: int | None = None,
    ):
        self.engine, self.stop_ids, self.max_batch = engine, stop_ids, max_batch
        res = engine.cfg.residency
        c = res.chunk_tokens
        self.budget = engine.sequence_budget(sequence_tokens or MAX_SEQUENCE_TOKENS)
        """Every sequence's budget in chunks: the most pool slots one request holds."""
        if self.budget < res.floor_chunks():
            raise KVFlashError(
                f"a sequence budget of {self.budget} chunks ({self.budget * c} tokens) is below the "
                f"floor of {res.floor_chunks()} chunks: a larger pool or --sequence-tokens"
            )
        budget = self.budget * c
        engine.warm_batches(max_batch, budget)
        self.cache = PrefixCache(engine, snapshots, budget_tokens=budget, capacity=None)
        self._held_by = HeldCache(engine.pool, engine.host)
        """Each sequence's slots, as admission counts them (`_make_room`)."""
        host = engine.host.max_slots * res.chunk_tokens
        self.max_context_tokens = budget if res.policy == "full" else max(budget, host)
        """The most tokens one sequence is sure to hold: its budget, or under an evicting policy the
        host tier (a chunk paged back in keeps its host copy, so sealed chunks all end up there)."""
        self.steps = 0
        """Batched forwards run."""
        self.batched = 0
        """Tokens they decoded: batched / steps is the mean batch."""
        self.prefill_steps = 0
        """Forwards that ran prefill pieces."""
        self.pieces = 0
        """Prefill pieces they ran: pieces / prefill_steps is the mean number of prompts per step."""
        self.on_step: Callable[[StepTime], None] | None = None
        """Sees each step's time, on the scheduler's thread (a server's /metrics)."""
        self._waited = 0.0
        """Seconds the step under way has waited for the device so far."""
        self.failure: BaseException | None = None
        """What stopped the loop, if anything did."""
        self._queue: queue.Queue[Job | object | None] = queue.Queue()
        self._unread = 0
        """Jobs submitted and still in `_queue` (its wake-ups and the close sentinel are no request)."""
        self._queued: collections.deque[Job] = collections.deque()
        """Jobs taken from `_queue` in the order they came, not yet admitted: in the loop's hands, so
        that a job whose client leaves or whose time is up ends while it waits (`_sweep`)."""
        self._swept = 0.0
        self._calls: collections.deque[Callable[[], None]] = collections.deque()
        """Functions to run on this thread before the next step (`call`)."""
        self._retry: collections.deque[Job] = collections.deque()
        """Requests admitted before the queue: those sent back to prefill (damaged lazy chunks), and
        at its head the one the pool has no room for yet."""
        self._deferred: list[Job] = []
        """Requests whose prompt begins as a busy request's does, waiting for it to end (`_admit`)."""
        self._running: list[Job] = []
        self._filling: list[Job] = []
        """Admitted requests still prefilling, in the order they came."""
        self._unsent: list[tuple[Job, int]] = []
        """Running jobs' tokens chosen at the last step, handed to their answers (`on_token`: the
        stream, the stop strings) while the next step runs on the device (`_send`)."""
        self._ahead: Ahead | None = None
        """The last step, when its tokens are still on the device (`_round`)."""
        self._readback = Readback(stop_ids, engine.lm.device)
        """What the steps left `Ahead` share: the stop ids on the device, pinned memory, an event."""
        self._closed = False
        """The queue has been closed (`close`): the loop ends once nothing is left to answer."""
        self._closing = False
        """`close` has begun: a job submitted now would queue behind the loop's end, so it is refused."""
        self._cancel = threading.Event()
        self.quiet = threading.Event()
        """Set while no request waits for its first token (none queued, sent back, deferred or
        prefilling): a server's snapshot saves wait for it (`Server`)."""
        self.quiet.set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvflash-scheduler", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet answered (a snapshot: the loop moves on meanwhile)."""
        return self.waiting + len(self._filling) + len(self._running)

    @property
    def pinned_chunks(self) -> int:
        """Chunks the admitted requests have pinned (a snapshot)."""
        held = [j.kv for j in [*self._filling, *self._running]]  # read once: the loop may drop one
        return sum(kv.n_pinned for kv in held if kv is not None)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted (a snapshot)."""
        return self._unread + len(self._queued) + len(self._retry) + len(self._deferred)

    def submit(self, job: Job) -> None:
        """Queues a job; SchedulerDown if the loop has stopped or is closing (it would never be
        answered)."""
        with self._lock:
            if not self.healthy or self._closing:
                raise SchedulerDown(f"the scheduler has stopped ({self.failure or 'closed'})")
            self.quiet.clear()
            self._unread += 1
            self._queue.put(job)

    def call(self, fn: Callable[[], None]) -> None:
        """Runs fn on this thread before its next step, or as soon as it waits for work: what
        touches sequences between steps (a deferred snapshot) runs where nothing else touches them.
        What fn raises is warned; a call queued as the loop stops is not run."""
        self._calls.append(fn)
        self._queue.put(_WAKE)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Answers what was submitted (with `cancel`, ends every request at its next piece or token
        instead), then stops and frees every sequence."""
        if cancel:
            self._cancel.set()
        with self._lock:
            self._closing = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            warnings.warn(f"the scheduler did not stop within {timeout} s", stacklevel=2)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a fault of the loop itself: answer everyone, never hang them
            with self._lock:
                self.failure = e
            down = SchedulerDown(f"the scheduler stopped: {type(e).__name__}: {e}")
            for job in self._held():
                self._fail(job, down)
        finally:
            with self._lock:
                self._closing = True  # what is submitted from now on is refused, not left queued
            for job in self._held():  # none after a loop that ended as it should
                self._fail(job, SchedulerDown("the scheduler has stopped"))
            self.quiet.set()  # nothing waits on a stopped loop
            try:
                self.cache.close()
            except Exception as e:
                warnings.warn(f"freeing the scheduler's sequences failed: {e}", stacklevel=2)

    def _held(self) -> list[Job]:
        """Every job not yet answered: running, filling, sent back and queued."""
        self._take_queued(block=False)
        jobs = [*self._running, *self._filling, *self._retry, *self._deferred, *self._queued]
        self._running, self._filling, self._deferred = [], [], []
        self._retry.clear()
        self._queued.clear()
        return jobs

    def _take_queued(self, block: bool) -> None:
        """Moves what was submitted into `_queued` (a wake-up does nothing more; the close sentinel
        sets `_closed`), waiting for the first item where `block`."""
        while True:
            try:
                item = self._queue.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._closed = True
            elif isinstance(item, Job):
                with self._lock:
                    self._unread -= 1
                self._queued.append(item)

    def _serve(self) -> None:
        while True:
            held = self._running or self._filling or self._retry or self._deferred or self._queued
            if not held and self._closed:
                return
            self._take_queued(block=not held)
            self._run_calls()
            self._sweep()
            self._admit()
            with self._lock:  # as `submit` clears it: a job submitted meanwhile is counted waiting
                if self._filling or self.waiting:
                    self.quiet.clear()
                else:
                    self.quiet.set()
            if self._running or self._filling:
                t0, self._waited = time.perf_counter(), 0.0
                kind = self._round()
                if kind is not None and self.on_step is not None:
                    self.on_step(StepTime(kind, time.perf_counter() - t0, self._waited))

    def _run_calls(self) -> None:
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception as e:  # a caller's trouble; every request waits on this thread
                warnings.warn(f"a call on the scheduler's thread failed: {e}", stacklevel=2)

    def _admit(self) -> None:
        """Starts waiting jobs, in order, while the pool has room for them and the batch is not full.
        A job whose prompt has whole chunks in common with a prefilling job's (one document, several
        conversations) waits until that prefill has sealed them, then shares them (`PrefixCache`)
        instead of computing the same prefix beside it."""
        while len(self._running) + len(self._filling) < self.max_batch:
            job = self._next_free_deferred() or self._next_job()
            if job is None:
                return
            if self._shares_busy_prefix(job):
                self._deferred.append(job)
                continue
            try:  # parking or freeing idle sequences for it may fail: the job is in no list yet
                fits = self._make_room(job)
            except Exception as e:
                self._fail(job, e)
                continue
            if not fits:
                self._retry.appendleft(job)
                return
            if self._start(job):
                self._filling.append(job)

    def need(self, job: Job) -> Room:
        """The slots a job may fill: a chunk per `chunk_tokens` of its prompt and answer and one for
        the append head, up to the budget in the pool; all of them on the host when it evicts (a
        chunk paged back in keeps its host copy), up to the host tier's size."""
        chunks = -(-(len(job.ids) + job.max_tokens) // self.engine.cfg.residency.chunk_tokens) + 1
        host = min(chunks, self.engine.host.max_slots) if chunks > self.budget else 0
        return Room(min(self.budget, chunks), host)

    def _make_room(self, job: Job) -> bool:
        """Whether the job's reservation fits beside the busy jobs' once idle sequences are freed;
        if so, parks or frees as many as it takes, oldest first, keeping the one the job continues. With no
        job busy it is always admitted (what it cannot hold fails it alone, at its own step).

        What the busy jobs and this one (with the sequence it continues, or the chunks it will
        share) may still take is `owed`; the room is the free slots and those that only idle
        sequences read, less the ones it continues or shares chunks from, which stay (a slot several
        sequences read counts once)."""
        job.need = self.need(job)
        busy = [*self._running, *self._filling]
        reuse = job.recoveries < RECOVERIES
        live = self.cache.continued(job.context) if reuse else None
        lent = self.cache.lendable(job.context) if reuse and live is None else ([], [])
        if reuse and live is None:  # a restore from disk keeps a host copy of each chunk it reads
            if job.restore_chunks is None:  # looked up once: the job may wait many rounds
                job.restore_chunks = self.cache.eager_restore_chunks(job.context, len(lent[0]) + len(lent[1]))
            job.need = Room(job.need.gpu, max(job.need.host, job.restore_chunks))
        held = self._held_by
        want, taken = owed(job.need, held(live), lent), Holdings()
        for j in busy:
            want += owed(j.need, held(j.kv))
            taken.add(held(j.kv))
        taken.add(held(live))
        free = Room(self.engine.pool.n_free, self.engine.host.max_slots - self.engine.host.n_used)
        lent_sets = set(lent[0]), set(lent[1])
        kept = [kv for kv in self.cache.idle if kv is live or held(kv).holds_any(*lent_sets)]
        idle, lenders = Holdings(), Holdings()
        for kv in self.cache.idle:
            if kv is not live:
                (lenders if any(kv is k for k in kept) else idle).add(held(kv))
        if busy and not (free + idle.beyond(taken, lenders, host_refs=self.engine.host.refs)).covers(want):
            return False
        self.cache.reclaim(want.gpu, want.host, keep=kept)
        return True

    def _shares_busy_prefix(self, job: Job) -> bool:
        """Whether a job still prefilling has whole chunks in common with the job that it has not
        sealed yet: once it has, the job shares them instead of computing them beside it. A busy
        job that has sealed as many chunks as the two prompts could share is not compared at all
        (many conversations over one document admitted together would compare each pair)."""
        c = self.engine.cfg.residency.chunk_tokens
        most = (len(job.ids) - 1) // c
        head = job.ids[:c]
        for j in self._filling:
            if j.kv is None or j.kv.seq.n_sealed >= min(most, len(j.ids) // c) or j.ids[:c] != head:
                continue
            common = job.common_chunks.get(j.serial)
            if common is None:
                common = job.common_chunks[j.serial] = common_prefix(j.ids, job.ids[: len(job.ids) - 1]) // c
            if j.kv.seq.n_sealed < common:
                return True
        return False

    def _next_free_deferred(self) -> Job | None:
        """The oldest deferred job that no busy job holds back any more."""
        for i, job in enumerate(self._deferred):
            if not self._shares_busy_prefix(job):
                return self._deferred.pop(i)
        return None

    def _next_job(self) -> Job | None:
        """A job sent back first, else the next queued one."""
        if self._retry:
            return self._retry.popleft()
        return self._queued.popleft() if self._queued else None

    def _sweep(self) -> None:
        """Ends the waiting jobs whose client left or whose time is up (every one when the server
        stops) now, not once a batch place or the pool's room comes: a request given up on should
        neither wait for its answer's error nor count among those waiting. At most every SWEEP_S."""
        now = time.perf_counter()
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        for waiting in (self._queued, self._retry, self._deferred):
            for job in [j for j in waiting if self._cut_short(j)]:
                waiting.remove(job)
                self._ended_early(job)

    def _ended_early(self, job: Job) -> bool:
        """Fails a job whose client left or whose time is up, or every job when the server stops,
        before it decodes. The sequence it continued goes back as it found it (`_give_back`)."""
        if job.expired():
            answered = len(job.gen.out) if job.gen else 0
            when = (f"while prefilling again after a damaged stored chunk, {answered} tokens into its answer"
                    if answered else "before its first token")  # fmt: skip
            limit = f"the request reached its time limit of {job.timeout_s:g} s"
            why = f"{limit} {when} (kvflash serve --request-timeout)"
            end: KVFlashError = TimedOut(why)
        elif job.gone.is_set() or self._cancel.is_set():
            end = Cancelled("the server is stopping" if self._cancel.is_set() else "the client went away")
        else:
            return False
        self._give_back(job)
        self._fail(job, end)
        return True

    def _give_back(self, job: Job) -> None:
        """A request ended before its first token keeps live the whole chunks of the sequence it
        continued or shared (what earlier turns computed; what it prefilled itself is cut off), for
        its conversation's next turn; a sequence it began cold or restored from disk is freed by
        `_fail` (the disk still holds what it restored)."""
        kv, held = job.kv, job.taken_chunks
        if kv is None or not held:
            return
        job.kv, job.prefill = None, None
        try:
            kv.unpin_all()
            kv.truncate(held)
            self.cache.keep(kv)
        except Exception as e:
            warnings.warn(f"the sequence of a request that ended early is freed: {e}", stacklevel=2)
            self.cache.drop(kv)

    def _start(self, job: Job) -> bool:
        """Takes a sequence for the job and plans its prefill; False if that failed."""
        if self._ended_early(job):
            return False
        job.stats.queued_s = time.perf_counter() - job.t0
        try:
            context = job.context
            taken = self.cache.take(context, reuse=job.recoveries < RECOVERIES)
            job.stats.took(taken)
            job.kv = taken.kv
            job.taken_chunks = job.kv.seq.n_sealed if taken.source in ("memory", "shared") else 0
            for lo, hi in job.pins:
                job.kv.pin_range(lo, hi)
            job.stats.pinned_chunks = job.kv.n_pinned
            rest = context[len(job.kv.seq) :]
            job.stats.prefilled_tokens = len(rest)
            job.prefill = self.engine.plan_prefill(job.kv, rest)
            return True
        except Exception as e:
            self._failed(job, e)
            return False

    def _round(self) -> str | None:
        """One step: a decode token of every running job and the next pieces of the filling ones,
        within the step's token budget (the first filling job always gets a piece). Its kind
        (`StepTime.kind`), or None where no forward ran whole.

        A step of decode tokens alone whose jobs are all greedy leaves its tokens on the device
        (`Ahead`): the next step, if it too is decode alone, takes them there and is launched
        before the host reads them. A job whose answer ends at a token read then (a stop id) has
        run that next step too, whose token is dropped: its sequence holds the stop id. What ends
        an answer whatever the token (max_tokens, `on_token`, its client gone, its time up) keeps
        the job out of the next step. The read-back of a step's tokens runs outside the step's
        recovery (a failed read is a failed device, which no step run again gets past)."""
        planned = self._plan_pieces()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            live = {id(j) for j in self._running}
            going = [j for j in ahead.jobs if id(j) in live and not self._will_end(j)]
            if planned or not going:
                self._collect(ahead, [])
                ahead = None
        if ahead is None:
            running, tokens = self._running, [j.next for j in self._running]
        else:
            running, tokens = going, ahead.rows(going)
        if not (planned or running):  # every filling job ended before its piece
            return None
        try:
            pieces = [p for _, p in planned]
            decoded, filled = self.engine.forward([j.kv for j in running], tokens, pieces)
        except Exception as e:
            if ahead is not None:
                self._collect(ahead, running)
            self._send()
            rows, running = len(running), [j for j in self._running if not self._ended(j)]
            if not planned:
                self._running = self._step_each(running, e, rows) if running else []
                return None
            self._running = self._step(running) if running else []
            for job, piece in planned:
                self._piece_alone(job, piece)
            return None
        self.steps += 1
        self.batched += len(running)
        self.prefill_steps += bool(planned)
        self.pieces += len(planned)
        if ahead is not None:
            self._collect(ahead, running)
        self._send()  # the last step's tokens, while this one runs on the device
        kind = "mixed" if running and planned else "decode" if running else "prefill"
        if running and not planned and all(j.gen.sampler.greedy for j in running):
            if self._running:  # else every job ended at the last tokens: this step's are dropped
                self._ahead = Ahead.launch(running, decoded, self._readback)
            return kind
        t0 = time.perf_counter()
        argmax = decoded.argmax(-1).tolist() if running else []  # greedy jobs' tokens in one read
        firsts = filled.argmax(-1).tolist() if planned else []  # and the pieces' greedy first tokens
        self._waited += time.perf_counter() - t0
        rows = zip(running, decoded if running else [], argmax, strict=True)
        self._running = [j for j, row, top in rows if self._choose(j, row, top)]
        for (job, piece), row, top in zip(planned, filled, firsts, strict=True):
            self._filled(job, piece, row, top)
        return kind

    def _plan_pieces(self) -> list[tuple[Job, Piece]]:
        """The filling jobs' next pieces, in the order they came, within the step's token budget
        beside the running jobs' decode tokens."""
        room = self.engine.step_tokens - len(self._running)
        planned: list[tuple[Job, Piece]] = []
        for job in list(self._filling):
            if room <= 0 and (planned or self._running):
                break
            if self._ended_early(job):
                self._filling.remove(job)
                continue
            try:
                piece = job.prefill.next(room)
            except Exception as e:
                self._filling.remove(job)
                self._failed(job, e)
                continue
            planned.append((job, piece))
            room -= len(piece.ids)
        return planned

    def _collect(self, ahead: Ahead, fed: list[Job]) -> None:
        """Reads back the tokens `ahead`'s step chose and chooses with them (`_choose`) for its jobs
        still running; `fed`, the jobs of the step launched since with those tokens on the device,
        learn them in their sequences."""
        t0 = time.perf_counter()
        tokens = ahead.tokens()
        self._waited += time.perf_counter() - t0
        row = {id(j): i for i, j in enumerate(ahead.jobs)}
        for job in fed:
            job.kv.settle(tokens[row[id(job)]])
        live = {id(j) for j in self._running}
        pairs = zip(ahead.jobs, tokens, strict=True)
        self._running = [j for j, tok in pairs if id(j) in live and self._choose(j, None, tok)]

    def _will_end(self, job: Job) -> bool:
        """Whether a running job's answer ends at its last step's token whatever that token is (see
        `_choose`): no further step need run it."""
        return bool(job.ended) or job.gen.last() or self._cut_short(job)

    def _send(self) -> None:
        """Hands the tokens chosen at the last step to their answers. It runs once the next step is
        launched, so that the streaming and stop-string work of a step's tokens overlaps the next
        step on the device instead of adding to it; an answer `on_token` ends here has run that next
        step too, whose token `_choose` drops (its sequence holds the answer's last token)."""
        unsent, self._unsent = self._unsent, []
        for job, tok in unsent:
            try:
                job.ended = not job.gen.emit(tok)
            except Exception as e:  # the job's own trouble: it fails once its step is out
                job.ended = e

    def _ended(self, job: Job) -> bool:
        """Ends a job whose answer ended at its last token sent (`_send`): finished, or failed with
        what its callback raised. Whether it had."""
        ended, job.ended = job.ended, False  # a job sent back to prefill (`_failed`) starts afresh
        if ended is False:
            return False
        if isinstance(ended, BaseException):
            self._failed(job, ended)
        else:
            self._finish(job)
        return True

    def _choose(self, job: Job, logits: torch.Tensor | None, argmax: int) -> bool:
        """A running job's next token, chosen from its step; whether it goes on. Its answer gets the
        token at the next `_send`, unless the answer ends with it (a stop id, max_tokens, its client
        gone, its time up, the server stopping): then now, and the job is finished."""
        if self._ended(job):
            return False
        try:
            tok = job.gen.choose(logits, argmax)
        except Exception as e:
            self._failed(job, e)
            return False
        if tok is None:
            return self._finish(job)
        if self._stops(job) or job.gen.last():
            try:
                job.gen.emit(tok)
            except Exception as e:
                self._failed(job, e)
                return False
            return self._finish(job)
        job.next = tok
        self._unsent.append((job, tok))
        return True

    def _piece_alone(self, job: Job, piece: Piece) -> None:
        try:
            row = self.engine.forward([], [], [piece])[1][0]
        except Exception as e:
            self._filling.remove(job)
            self._failed(job, e)
            return
        self._filled(job, piece, row)

    def _filled(self, job: Job, piece: Piece, logits: torch.Tensor, argmax: int | None = None) -> None:
        """A piece of the job's prefill ran; after its last the job samples its first token (a
        greedy job takes `argmax`, read back with the step's others) and decodes from the next step
        on (unless its answer ended there, or it failed)."""
        job.prefill.ran(piece)
        if not piece.final:
            return
        if job.gen is None:  # else a job sent back goes on with its answer
            try:
                sampler = Sampler(job.sampling, self.engine.lm.device)
            except Exception as e:
                self._filling.remove(job)
                self._failed(job, e)
                return
            job.gen = Generation(job.max_tokens, sampler, self.stop_ids, job.on_token, job.min_tokens, job.t0)
        going = self._advance(job, logits, argmax)  # held as filling meanwhile: a loop that dies answers it
        self._filling.remove(job)
        if going:
            self._running.append(job)

    def _step(self, running: list[Job]) -> list[Job]:
        """One token for each running job, in one forward; if that raises, each job alone."""
        try:
            logits = self.engine.decode_batch([j.kv for j in running], [j.next for j in running])
            argmax = logits.argmax(-1).tolist()
        except Exception as e:
            return self._step_each(running, e, len(running))
        self.steps += 1
        self.batched += len(running)
        rows = zip(running, logits, argmax, strict=True)
        return [j for j, row, top in rows if self._advance(j, row, top)]

    def _step_each(self, running: list[Job], e: Exception, rows: int) -> list[Job]:
        """After a step of `rows` decode rows raised `e`: the job that was its only row fails with
        it, else each job still running steps alone (the one that failed it may have ended since)."""
        if rows == 1:
            self._failed(running[0], e)
            return []
        return [j for j in running if self._step_alone(j)]

    def _step_alone(self, job: Job) -> bool:
        try:
            logits = self.engine.decode_batch([job.kv], [job.next])[0]
        except Exception as e:
            self._failed(job, e)
            return False
        return self._advance(job, logits)

    def _advance(self, job: Job, logits: torch.Tensor, argmax: int | None = None) -> bool:
        """The job's next token (`Generation.next`, the decode loop's body; a greedy job takes `argmax`
        where given); whether it goes on. Nothing a job's callbacks raise may end this thread: every
        other request waits on it."""
        try:
            tok = job.gen.next(logits, argmax)
        except Exception as e:
            self._failed(job, e)
            return False
        if tok is not None and not self._stops(job):
            job.next = tok
            return True
        return self._finish(job)

    def _stops(self, job: Job) -> bool:
        """Whether a job that has a next token ends its answer there anyway: its client gone, its
        time up (`timed_out`) or the server stopping."""
        stops = self._cut_short(job)
        job.timed_out = stops and job.expired()
        return stops

    def _cut_short(self, job: Job) -> bool:
        """Its client gone, its time up or the server stopping (`_stops`, without marking it)."""
        return job.gone.is_set() or self._cancel.is_set() or job.expired()

    def _finish(self, job: Job) -> bool:
        """Ends a job's answer: its sequence kept live for the next turn, `on_done` told. False (the
        job does not go on)."""
        try:
            out = job.gen.finish()
            job.stats.answered(job.gen, job.kv)
            job.kv.unpin_all()  # a request's pins are its own, not the next turn's
            self.cache.keep(job.kv)  # before on_done: whoever hears of the answer finds it live
        except Exception as e:
            self._failed(job, e)
            return False
        try:
            job.on_done(out, job.stats, job.kv)
        except Exception as e:  # the answer is out; its consumer's trouble is not the engine's
            warnings.warn(f"request callback failed: {e}", stacklevel=2)
        return False

    def _failed(self, job: Job, e: BaseException) -> None:
        """A job's step raised: a damaged stored chunk sends it back to prefill; else it fails."""
        if isinstance(e, ChunkError) and job.recoveries < RECOVERIES:
            warnings.warn(f"a stored chunk is unusable ({e}); prefilling the request again", stacklevel=2)
            self._free(job)
            job.recoveries += 1
            job.restore_chunks = None  # its context has grown, and the damaged snapshot may be gone
            self._retry.append(job)
            return
        self._fail(job, e)

    def _free(self, job: Job) -> None:
        if job.kv is not None:
            kv, job.kv, job.prefill = job.kv, None, None
            try:
                self.cache.drop(kv)
            except Exception as e:
                warnings.warn(f"freeing a failed request's sequence failed: {e}", stacklevel=2)

    def _fail(self, job: Job, e: BaseException) -> None:
        self._free(job)
        try:
            job.on_error(e)
        except Exception as again:
            warnings.warn(f"request error callback failed: {again} (on {e})", stacklevel=2)
