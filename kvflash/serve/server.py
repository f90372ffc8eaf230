"""`Server`: the scheduler over the engine, the tokenizer and the snapshot store, behind the HTTP
routes (kvflash/serve/routes.py).

A chat request's prompt is the chat template over its messages; a text completion's is its prompt
string, after the model's BOS. The prefix cache reuses a live sequence
when the prompt extends a conversation served before (the client sent it back with one more
question), else the longest prefix stored on disk; after the answer the sealed prefix is snapshotted,
so a conversation's next turn, in this process or after a restart, restores instead of prefilling.

Requests go to the scheduler (`kvflash/serve/scheduler.py`), whose thread decodes up to `max_batch` of them
together; a staged snapshot is written by a saver thread of its own.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvflash import KVFlashError, heap
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.engine.host_tier import HostTierFull
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import PoolFull
from kvflash.engine.residency import check_pins, chunks_of
from kvflash.models.tokenizer import StreamDecoder, Tokenizer
from kvflash.serve.admission import Held, Holdings
from kvflash.serve.content_ids import ContentIds
from kvflash.serve.job import Job
from kvflash.serve.metrics import ServerMetrics, device_readings
from kvflash.serve.pins import request_pins
from kvflash.serve.prompt import encode_messages
from kvflash.serve.protocol import ChatRequest, Completion, CompletionRequest, Message
from kvflash.serve.scheduler import Cancelled, Scheduler, SchedulerDown, TimedOut
from kvflash.serve.snapshots import KVSnapshots, StagedSnapshot
from kvflash.serve.turn import TurnStats


class StopText:
    """Answer text as it streams, cut before the first stop string; what might begin one is held
    back until the next piece shows whether it does."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False

    def push(self, piece: str) -> str:
        """The text that can be sent now. A stop string found now ends in the new piece, so the
        search starts just before it (a long answer is not rescanned at every token)."""
        start = len(self.text)
        self.text += piece
        cuts = [i for s in self.stops if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        if cuts:
            self.text, self.stopped = self.text[: min(cuts)], True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def _held(self) -> int:
        """How many characters at the text's end begin some stop string (the most of any). Only
        where a stop's first character stands among the text's last len(stop) - 1 characters can
        one begin: comparing every prefix of every stop cost up to 0.5 ms a token, on the thread
        that runs the scheduler."""
        text, held = self.text, 0
        n = len(text)
        for s in self.stops:
            i = text.find(s[0], max(0, n - len(s) + 1), n - held)
            while i >= 0 and not s.startswith(text[i:]):
                i = text.find(s[0], i + 1, n - held)
            if i >= 0:
                held = n - i
        return held

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out


MAX_UNSAVED = 4
"""Staged snapshots waiting for the saver, at most: each holds a copy of its new chunks' KV (46 MB
for 1,000 tokens of the default model in fp32), and short answers come faster than zstd writes
them, so an unbounded queue grows with every answer the disk has not caught up with. Past it an
answer's snapshot is deferred: its conversation's live sequence is staged once a save has finished,
if it is still idle by then (a next turn saves it itself; one freed for room restores the prefix it
saved last)."""

SAVE_YIELD_S = 0.5
"""Seconds a snapshot save waits, in all, for the moments when no request waits for its first
token (`Scheduler.quiet`): its encoding shares the interpreter with the scheduler, and a burst of
new questions (the next turns of many conversations) should not share it with the last burst's
saves. Bounded, so that a server never idle still saves each answer at most this much later.
Saves that waited while requests decode as well would spend the bound before the next burst's
first tokens, which need it more."""


IDLE_TRIM_S = 1.0
"""How often the server looks whether it has gone idle since it last handed malloc's free memory back
(`heap.trim`): a burst of requests leaves its buffers free in malloc's arenas, in the process's RSS."""


@dataclass(frozen=True)
class Deferred:
    """An answer whose snapshot waits for the saver: its live sequence, its prompt's length, and
    what the sequence was then (its steps and whole chunks), so that a sequence another
    conversation took meanwhile is not saved under this one's label."""

    kv: PagedKV
    prompt_tokens: int
    step: int
    sealed: int

    def unchanged(self) -> bool:
        """No step has run in the sequence and none of its whole chunks was cut (a park keeps them)."""
        return self.kv.step == self.step and self.kv.seq.n_sealed >= self.sealed


@dataclass(frozen=True)
class Prompt:
    """A request's prompt ids, the most tokens its answer may take, its snapshot label and the token
    ranges [lo, hi) it pins. Made off the event loop (`Server.prompt`): the label hashes the
    document."""

    ids: list[int]
    max_tokens: int
    label: str
    pins: tuple[tuple[int, int], ...] = ()


class Server:
    """The scheduler over the engine, the tokenizer and the snapshot store behind the HTTP routes."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        model_name: str,
        snapshots: KVSnapshots | None,
        default_max_tokens: int = 512,
        max_batch: int = 32,
        max_prompt_tokens: int | None = None,
        max_waiting: int = 256,
        sequence_tokens: int | None = None,
        request_timeout: float | None = None,
    ):
        self.tok, self.model_name, self.snapshots = tokenizer, model_name, snapshots
        self.max_waiting = max_waiting
        """Requests that may wait for admission; past them a request is refused (429): a client
        that is told to come back later loses less than one whose request waits without bound."""
        self.default_max_tokens = default_max_tokens
        self.request_timeout = request_timeout
        """Seconds a request may take from its arrival: one not yet answering then fails (504), one
        answering ends its answer there (finish reason `length`)."""
        self.scheduler = Scheduler(engine, snapshots, tokenizer.eos_ids, max_batch, sequence_tokens)
        if snapshots is not None:
            snapshots.store.yield_saves_to(self.scheduler.quiet, SAVE_YIELD_S)
            engine.host.yield_to(self.scheduler.quiet, SAVE_YIELD_S)
        engine.pool.reset_peak()  # the warm-up's scratch sequences are not the server's use
        self.content_ids = ContentIds(tokenizer)
        self.metrics = ServerMetrics(self.readings)
        self.scheduler.on_step = self.metrics.stepped
        self.max_prompt_tokens = max_prompt_tokens or self.scheduler.max_context_tokens - default_max_tokens
        self.created = int(time.time())
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvflash-save")
        """Writes staged snapshots in order, off the scheduler's thread."""
        self.unsaved = 0
        """Staged snapshots not yet written (at most MAX_UNSAVED)."""
        self._staging = 0
        """Host slots the requests in flight will stage their snapshots in (`_promise_host`)."""
        self._staged_slots = 0
        """Host slots the staged snapshots not yet written copied their chunks into
        (`StagedSnapshot.taken`): staging room that their writes give back."""
        self._deferred: OrderedDict[str, Deferred] = OrderedDict()
        """Label -> answers not staged while MAX_UNSAVED waited, oldest first; a conversation's newer
        answer replaces its older one."""
        self._counts = threading.Lock()
        self._closing = threading.Event()
        threading.Thread(target=self._trim_when_idle, daemon=True, name="kvflash-trim").start()

    def close(self, timeout: float = 60.0) -> None:
        """Ends the requests in flight at their next prefill piece or token (their clients are gone
        by now: the HTTP server has stopped), then waits for the snapshots still being written.
        Deferred snapshots are not staged any more (the sequences are freed with the scheduler)."""
        self._closing.set()
        self.scheduler.close(cancel=True, timeout=timeout)
        self._saver.shutdown()
        with self._counts:
            dropped, self._deferred = len(self._deferred), OrderedDict()
        if dropped:
            self.metrics.saves.labels("skipped").inc(dropped)
            warnings.warn(f"{dropped} answers' snapshots were not saved: the server stopped before "
                          "the saver caught up with them", stacklevel=2)  # fmt: skip

    def prompt(self, req: ChatRequest | CompletionRequest) -> Prompt:
        """The prompt's ids (a chat's rendered by the model's template; a completion's prompt is
        user text after the model's BOS), its answer's length and the token ranges it pins;
        KVFlashError for a template that refuses the messages, a prompt longer than
        `max_prompt_tokens`, an answer asked for that would not fit one sequence after it
        (ContextTooLong, as OpenAI refuses one past the model's context) or pins that no sequence
        could hold: refused before they take the engine's time, where they would fail late and
        their answer so far be lost. An answer of no asked length takes the server's default, up
        to the room the prompt leaves."""
        pins: list[tuple[int, int]] = []
        if isinstance(req, CompletionRequest):
            ids = [self.tok.bos_id] * self.tok.add_bos + self.tok.encode_plain(req.prompt)
            label = prompt_label(req.prompt)
        else:
            label = conversation_label(req.messages)
            messages, spans = [m.as_template_message() for m in req.messages], {}
            ids = encode_messages(self.tok, messages, known=self.content_ids.known(messages), spans=spans)
            pins = request_pins(self.tok, messages, spans, req.kvflash.pin)
        if len(ids) > self.max_prompt_tokens:
            raise ContextTooLong(
                f"context too long: the prompt has {len(ids)} tokens, this server takes at most "
                f"{self.max_prompt_tokens} (kvflash serve --max-prompt-tokens)"
            )
        most, asked = self.scheduler.max_context_tokens, req.asked_tokens()
        if len(ids) + (asked or 1) > most:
            answer = f" and the answer may take {asked} (max_tokens)" if asked else ""
            raise ContextTooLong(
                f"context too long: the prompt has {len(ids)} tokens{answer}; a sequence on this "
                f"server holds at most {most}"
            )
        max_tokens = asked or min(self.default_max_tokens, most - len(ids))
        if pins:
            cfg = self.scheduler.engine.cfg.residency
            check_pins(cfg, self.scheduler.budget, len(chunks_of(pins, cfg.chunk_tokens)))
        return Prompt(ids, max_tokens, label, tuple(pins))

    def submit(
        self,
        req: ChatRequest | CompletionRequest,
        prompt: Prompt,
        emit: Callable[[str | Completion | BaseException], None],
        gone: threading.Event,
    ) -> None:
        """Queues one request: `emit` gets the answer's text piece by piece, then the Completion (or
        the error). The sealed prefix is then staged (its new chunks copied) and written by the
        saver thread, so neither this client nor the requests decoding beside it wait for the disk.
        `gone` set (the client left) ends the request at its next prefill piece or token. Callbacks
        run on the scheduler's thread. SchedulerDown if the scheduler has stopped, Busy if
        `max_waiting` requests already wait."""
        if self.scheduler.waiting >= self.max_waiting:
            raise Busy(
                f"{self.scheduler.waiting} requests are waiting, the most this server queues "
                f"(kvflash serve --max-waiting); retry later"
            )
        ids, max_tokens = prompt.ids, prompt.max_tokens
        stop, decoder = StopText(req.stop_strings()), StreamDecoder(self.tok)

        chunks = len(ids) // self.scheduler.engine.cfg.residency.chunk_tokens if self.snapshots else 0
        settled = False

        def settle() -> None:
            """The request has staged its snapshot, or will not: its promised host slots are no
            longer counted (once, whichever way it ends)."""
            nonlocal settled
            if not settled:
                settled = True
                self._promise_host(-chunks)

        def relay(item: str | Completion | BaseException) -> None:
            if isinstance(item, BaseException):
                settle()
                self.metrics.failed(ending(item).outcome)
            emit(item)

        last = 0.0

        def on_token(tok: int) -> bool:
            nonlocal last
            now = time.perf_counter()
            if last:
                self.metrics.itl.observe(now - last)
            last = now
            if piece := stop.push(decoder.push(tok)):
                relay(piece)
            return stop.stopped

        def on_done(out: list[int], stats: TurnStats, kv: PagedKV) -> None:
            try:  # whatever raises here, the promise of host slots is settled
                if not stop.stopped and (tail := stop.push(decoder.flush()) + stop.flush()):
                    relay(tail)
                finish = (
                    "length" if (len(out) >= max_tokens or job.timed_out) and not stop.stopped else "stop"
                )
                self.metrics.answered("cancelled" if gone.is_set() else finish, stats)
                relay(Completion(stop.text, finish, len(ids), len(out), stats))
                if self.snapshots:
                    self._stage(kv, prompt.label, len(ids))
            finally:
                settle()

        sampling = Sampling(req.temperature, req.top_p, req.sampling_seed())
        job = Job(ids, max_tokens, sampling, on_token, on_done, relay, gone, min_tokens=req.min_tokens,
                  pins=prompt.pins, timeout_s=self.request_timeout)  # fmt: skip
        self._promise_host(chunks)  # host memory to stage the answer's snapshot in
        try:
            self.scheduler.submit(job)
        except BaseException:
            settle()
            raise
        self._grow_staging_room(chunks)  # pinned once no request waits for its first token

    def _stage(self, kv: PagedKV, label: str, prompt_tokens: int) -> None:
        """Stages an answered sequence's sealed prefix (its new chunks copied) for the saver thread,
        or defers it while MAX_UNSAVED staged snapshots wait (`_catch_up` stages it later)."""
        self.snapshots.start_prefetch(kv)
        if not kv.seq.n_sealed:  # a short chat: no whole chunk to save
            return
        with self._counts:  # one lock with `_saved`: a save that ends now sees this one deferred
            deferred = self.unsaved >= MAX_UNSAVED
            self._deferred.pop(label, None)  # this answer's snapshot supersedes an older deferred one
            if deferred:
                self._deferred[label] = Deferred(kv, prompt_tokens, kv.step, kv.seq.n_sealed)
            else:
                self.unsaved += 1
        if deferred:
            self.metrics.saves.labels("deferred").inc()
            return
        self._stage_taken(kv, label, prompt_tokens)

    def _stage_taken(self, kv: PagedKV, label: str, prompt_tokens: int) -> None:
        """`_stage` once an unsaved place is taken."""
        try:
            staged = self.snapshots.stage(kv)  # a store error here only costs the reuse
        except BaseException:
            self.metrics.saves.labels("failed").inc()
            self._saved()
            raise
        with self._counts:
            self._staged_slots += staged.taken
        try:
            self._saver.submit(self._save, staged, label, prompt_tokens)
        except BaseException:  # the saver has stopped: the staged copy's host slots come back
            staged.release()
            self._saved(staged)
            raise

    def _promise_host(self, chunks: int) -> None:
        """Counts the host slots that requests in flight will stage their snapshots in (`chunks`
        more, or fewer once one has staged)."""
        with self._counts:
            self._staging += chunks

    def _grow_staging_room(self, chunks: int) -> None:
        """Has the host tier pin memory for the promised staging ahead, up to MAX_UNSAVED snapshots
        of a request's `chunks`, once no request waits for its first token (`yield_to`):
        pinning for each request's own chunks alone would leave concurrent requests staging into a
        tier without free slots, whose chunks are then copied on the scheduler's thread. No more
        than MAX_UNSAVED are staged at once, so the slots of those staged and not yet written are
        part of that room, not beside it: the next burst of requests stages as their writes give
        them back, and a tier grown for two rooms would pin a second one that is never used."""
        with self._counts:
            want = min(self._staging, MAX_UNSAVED * chunks)
            staged = self._staged_slots
        if want:
            host = self.scheduler.engine.host
            host.reserve(host.n_used - staged + want, later=True)

    def readings(self) -> dict[str, tuple[str, str, float]]:
        """The engine's and the scheduler's state for /metrics: name -> (type, help, value)."""
        sched, pool, host = self.scheduler, self.scheduler.engine.pool, self.scheduler.engine.host
        idle = Holdings()
        for kv in list(sched.cache.idle):
            idle.add(Held.of(kv))
        kept = idle.beyond()
        return {
            "requests_in_flight": ("gauge", "Requests submitted and not yet answered.", sched.in_flight),
            "requests_waiting": ("gauge", "Requests submitted and not yet admitted.", sched.waiting),
            "live_sequences": (
                "gauge",
                "Sequences kept live on the GPU for a next turn.",
                len(sched.cache.idle),
            ),
            "pool_slots": ("gauge", "Chunk slots of the GPU pool.", pool.n_slots),
            "pool_slots_used": ("gauge", "GPU pool slots holding a chunk, a shared one once.", pool.n_used),
            "pool_tokens_used": (
                "gauge",
                "Tokens the GPU pool's slots in use hold room for, a shared slot once.",
                pool.n_used * pool.chunk_tokens,
            ),
            "pool_slots_shared": ("gauge", "GPU pool slots read by more than one sequence.", pool.n_shared),
            "pool_slots_idle": (
                "gauge",
                "GPU pool slots that idle live sequences hold, a shared one once: a cache that gives way "
                "to new requests. With nothing in flight, every slot in use is one of them.",
                kept.gpu,
            ),
            "pool_slots_used_peak": (
                "gauge",
                "The most GPU pool slots in use at once since the server started.",
                pool.peak_used,
            ),
            "host_tier_slots": ("gauge", "Chunk slots the host tier may grow to.", host.max_slots),
            "host_tier_slots_used": ("gauge", "Host tier slots holding a chunk.", host.n_used),
            "host_tier_slots_idle": (
                "gauge",
                "Host tier slots that idle live sequences hold, a shared one once.",
                kept.host,
            ),
            "host_tier_bytes_allocated": (
                "gauge",
                "Host memory the host tier has allocated (it keeps its blocks; at most --host-bytes).",
                host.n_allocated * host.slot_bytes,
            ),
            "pinned_chunks": ("gauge", "Chunks the requests in flight have pinned.", sched.pinned_chunks),
            "snapshots_unsaved": ("gauge", "Staged snapshots waiting for the disk.", self.unsaved),
            "forward_steps_total": ("counter", "Forwards run (decode and prefill).", sched.steps),
            "batched_tokens_total": ("counter", "Tokens those forwards decoded.", sched.batched),
            "prefill_steps_total": ("counter", "Forwards that ran prefill pieces.", sched.prefill_steps),
            "prefill_pieces_total": ("counter", "Prefill pieces those forwards ran.", sched.pieces),
        } | device_readings(pool.kv.device)

    def _trim_when_idle(self) -> None:
        """Once the requests of a burst have all ended and their snapshots are written, hands the
        memory malloc holds free back to the system, once per idle spell: RSS after a burst then
        returns to what the live sequences, the host tier and the model hold."""
        trimmed_at = 0
        while not self._closing.wait(IDLE_TRIM_S):
            steps = self.scheduler.steps  # forwards run: nothing ran since the last trim if unchanged
            if steps != trimmed_at and not self.scheduler.in_flight and not self.unsaved:
                heap.trim()
                trimmed_at = steps

    def _saved(self, staged: StagedSnapshot | None = None) -> None:
        """A staged snapshot (or a place taken for one) is written, failed or dropped."""
        with self._counts:
            self.unsaved -= 1
            self._staged_slots -= staged.taken if staged is not None else 0
            behind = bool(self._deferred)
        if behind and not self._closing.is_set():
            self.scheduler.call(self._catch_up)

    def _catch_up(self) -> None:
        """Stages deferred snapshots, oldest first, while places are free (on the scheduler's
        thread, between steps: nothing else touches the sequences there). One whose sequence is no
        longer the answer's is dropped: taken by a next turn (which saves it itself) or by another
        conversation that shares its chunks (a step ran in it, or it was cut), or freed."""
        while True:
            with self._counts:
                if not self._deferred or self.unsaved >= MAX_UNSAVED:
                    return
                label, d = self._deferred.popitem(last=False)
                self.unsaved += 1
            if not (any(d.kv is idle for idle in self.scheduler.cache.idle) and d.unchanged()):
                self.metrics.saves.labels("skipped").inc()
                self._saved()
                continue
            self._stage_taken(d.kv, label, d.prompt_tokens)

    def _save(self, staged: StagedSnapshot, label: str, prompt_tokens: int) -> None:
        """Writes a staged snapshot under its conversation's label, replacing the older snapshot of
        that conversation (`KVSnapshots.replace`): chunks are shared, so a conversation that lost
        its snapshot still finds the document's. A full disk only warns."""
        try:
            self.snapshots.replace(staged, label, {"prompt_tokens": prompt_tokens})
            self.metrics.saves.labels("saved").inc()
        except Exception as e:  # on the saver thread: nobody else would hear of it
            self.metrics.saves.labels("failed").inc()
            warnings.warn(f"could not save the snapshot: {e}", stacklevel=2)
        finally:
            self._saved(staged)


class ContextTooLong(KVFlashError):
    """A prompt, or a prompt and the answer it asks for, longer than this server takes."""


@dataclass(frozen=True)
class Ending:
    """How a request that the engine ended with an error is answered and counted."""

    status: int
    kind: str
    """The OpenAI error type."""
    outcome: str
    """Its `kvflash_requests` outcome."""


def ending(e: BaseException) -> Ending:
    """What a request itself gets wrong is refused before it reaches the engine (400), so what ends
    it there is the server's: a stopped scheduler or KV memory that other requests hold now (503,
    worth a retry), its time limit (504), anything else (500; a cancelled request's client is gone)."""
    if isinstance(e, Cancelled):
        return Ending(500, "server_error", "cancelled")
    if isinstance(e, TimedOut):
        return Ending(504, "timeout_error", "timeout")
    if isinstance(e, SchedulerDown):
        return Ending(503, "server_error", "down")
    if isinstance(e, PoolFull | HostTierFull):
        return Ending(503, "server_error", "full")
    return Ending(500, "server_error", "error")


class Busy(KVFlashError):
    """The waiting queue is full."""


def conversation_label(messages: list[Message]) -> str:
    """The snapshot label of a conversation: a hash of its messages up to its first user message
    (the document and the first question, as a rule), which every later turn resends unchanged.
    Two conversations over one document get two labels, so neither replaces the other's snapshot."""
    head = []
    for m in messages:
        head.append(m.as_template_message())
        if m.role == "user":
            break
    text = json.dumps(head, sort_keys=True, ensure_ascii=False)
    return "serve:" + hashlib.sha256(text.encode()).hexdigest()[:16]


LABEL_CHARS = 4096
"""A text completion's snapshot label hashes this much of its prompt's head."""


def prompt_label(prompt: str) -> str:
    """The snapshot label of a text completion: a hash of its prompt's first LABEL_CHARS characters
    (the document, as a rule), so a prompt that extends an earlier one replaces that one's snapshot;
    chunks are shared, so another question over the document still finds the document's."""
    return "complete:" + hashlib.sha256(prompt[:LABEL_CHARS].encode()).hexdigest()[:16]
