"""An OpenAI-compatible HTTP server: /v1/chat/completions and /v1/completions (streamed or not) and
/v1/models over one engine, with KV reused across requests.

A chat request's prompt is the chat template over its messages; a text completion's is its prompt
string, after the model's BOS. The prefix cache reuses a live sequence
when the prompt extends a conversation served before (the client sent it back with one more
question), else the longest prefix stored on disk; after the answer the sealed prefix is snapshotted,
so a conversation's next turn, in this process or after a restart, restores instead of prefilling.
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were reused.

Requests go to the scheduler (`kvflash/serve/scheduler.py`), whose thread decodes up to `max_batch` of them
together; the event loop only renders prompts and relays text, and a client that goes away
mid-stream ends its answer at the next step.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as Message_

from kvflash import KVFlashError, heap
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.engine.paged_kv import PagedKV
from kvflash.models.tokenizer import StreamDecoder, Tokenizer
from kvflash.serve.content_ids import ContentIds
from kvflash.serve.metrics import ServerMetrics
from kvflash.serve.prompt import encode_messages
from kvflash.serve.scheduler import Job, Scheduler, SchedulerDown
from kvflash.serve.snapshots import KVSnapshots, StagedSnapshot
from kvflash.serve.turn import TurnStats


def _utf8(text: str) -> str:
    """JSON can carry lone surrogates (`"\\ud800"`), which are no text: refused as bad input."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text ({e.reason} at {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
MAX_STOPS = 16
MAX_STOP_CHARS = 256
"""Stop strings are searched for at every token: their number and length are bounded."""
StopString = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        """`developer` is the newer name of `system`; text parts are joined."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampled(BaseModel):
    """The fields the chat and the text completion requests share; others are ignored."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    min_tokens: int = Field(0, ge=0, lt=2**31)
    """vLLM's extension: the end-of-sequence ids are not sampled before this many tokens."""
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def answer_tokens(self, default: int) -> int:
        return self.max_tokens or default


class ChatRequest(Sampled):
    """OpenAI's chat completion request, as far as kvflash honours it."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def answer_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(Sampled):
    """OpenAI's (legacy) text completion request: one prompt string, its continuation back."""

    prompt: Text = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    """OpenAI's default for this route."""


@dataclass
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: TurnStats

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.stats.restored_tokens},
        }


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
        held = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - held)

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
answer's prefix is not saved (its conversation restores the prefix it saved last)."""


IDLE_TRIM_S = 1.0
"""How often the server looks whether it has gone idle since it last handed malloc's free memory back
(`heap.trim`): a burst of requests leaves its buffers free in malloc's arenas, in the process's RSS."""


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
    ):
        self.tok, self.model_name, self.snapshots = tokenizer, model_name, snapshots
        self.max_waiting = max_waiting
        """Requests that may wait for admission; past them a request is refused (429): a client
        that is told to come back later loses less than one whose request waits without bound."""
        self.default_max_tokens = default_max_tokens
        self.scheduler = Scheduler(engine, snapshots, tokenizer.eos_ids, max_batch, sequence_tokens)
        engine.pool.reset_peak()  # the warm-up's scratch sequences are not the server's use
        self.content_ids = ContentIds(tokenizer)
        self.metrics = ServerMetrics()
        self.max_prompt_tokens = max_prompt_tokens or self.scheduler.max_context_tokens - default_max_tokens
        self.created = int(time.time())
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvflash-save")
        """Writes staged snapshots in order, off the scheduler's thread."""
        self.unsaved = 0
        """Staged snapshots not yet written (at most MAX_UNSAVED)."""
        self._unsaved_lock = threading.Lock()
        self._closing = threading.Event()
        threading.Thread(target=self._trim_when_idle, daemon=True, name="kvflash-trim").start()

    def close(self, timeout: float = 60.0) -> None:
        """Ends the requests in flight at their next prefill piece or token (their clients are gone
        by now: the HTTP server has stopped), then waits for the snapshots still being written."""
        self._closing.set()
        self.scheduler.close(cancel=True, timeout=timeout)
        self._saver.shutdown()

    def prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        """The prompt's ids (a chat's rendered by the model's template; a completion's prompt is
        user text after the model's BOS); KVFlashError for a template that refuses the messages or
        a prompt longer than `max_prompt_tokens` (refused before it takes the engine's time)."""
        if isinstance(req, CompletionRequest):
            ids = [self.tok.bos_id] * self.tok.add_bos + self.tok.encode_plain(req.prompt)
        else:
            messages = [m.as_template_message() for m in req.messages]
            ids = encode_messages(self.tok, messages, known=self.content_ids.known(messages))
        if len(ids) > self.max_prompt_tokens:
            raise ContextTooLong(
                f"context too long: the prompt has {len(ids)} tokens, this server takes at most "
                f"{self.max_prompt_tokens} (kvflash serve --max-prompt-tokens)"
            )
        return ids

    def submit(
        self,
        req: ChatRequest | CompletionRequest,
        ids: list[int],
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
        max_tokens = req.answer_tokens(self.default_max_tokens)
        stop, decoder = StopText(req.stop_strings()), StreamDecoder(self.tok)
        label = conversation_label(req.messages) if isinstance(req, ChatRequest) else prompt_label(req.prompt)

        def relay(item: str | Completion | BaseException) -> None:
            if isinstance(item, BaseException):
                self.metrics.failed()
            emit(item)

        def on_token(tok: int) -> bool:
            if piece := stop.push(decoder.push(tok)):
                relay(piece)
            return stop.stopped

        def on_done(out: list[int], stats: TurnStats, kv: PagedKV) -> None:
            if not stop.stopped and (tail := stop.push(decoder.flush()) + stop.flush()):
                relay(tail)
            finish = "length" if len(out) >= max_tokens and not stop.stopped else "stop"
            self.metrics.answered(finish, stats)
            relay(Completion(stop.text, finish, len(ids), len(out), stats))
            if self.snapshots:
                self.snapshots.start_prefetch(kv)
                if not kv.seq.n_sealed:  # a short chat: no whole chunk to save
                    return
                if not self._take_unsaved():
                    warnings.warn("snapshot writes are behind: this answer is not saved", stacklevel=2)
                    return
                try:
                    staged = self.snapshots.stage(kv)  # a store error here only costs the reuse
                except BaseException:
                    self._saved()
                    raise
                try:
                    self._saver.submit(self._save, staged, label, len(ids))
                except BaseException:  # the saver has stopped: the staged copy's host slots come back
                    self._saved()
                    staged.release()
                    raise

        if self.snapshots:  # host memory to stage the answer's snapshot in, pinned while it prefills
            host = self.scheduler.engine.host
            host.reserve(host.n_used + len(ids) // host.pool.chunk_tokens)
        sampling = Sampling(req.temperature, req.top_p, req.seed)
        job = Job(ids, max_tokens, sampling, on_token, on_done, relay, gone, min_tokens=req.min_tokens)
        self.scheduler.submit(job)

    def readings(self) -> dict[str, tuple[str, str, float]]:
        """The engine's and the scheduler's state for /metrics: name -> (type, help, value)."""
        sched, pool, host = self.scheduler, self.scheduler.engine.pool, self.scheduler.engine.host
        return {
            "requests_in_flight": ("gauge", "Requests submitted and not yet answered.", sched.in_flight),
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
            "pool_slots_used_peak": (
                "gauge",
                "The most GPU pool slots in use at once since the server started.",
                pool.peak_used,
            ),
            "host_tier_slots": ("gauge", "Chunk slots the host tier may grow to.", host.max_slots),
            "host_tier_slots_used": ("gauge", "Host tier slots holding a chunk.", host.n_used),
            "host_tier_bytes_allocated": (
                "gauge",
                "Host memory the host tier has allocated (it keeps its blocks; at most --host-bytes).",
                host.n_allocated * host.slot_bytes,
            ),
            "snapshots_unsaved": ("gauge", "Staged snapshots waiting for the disk.", self.unsaved),
            "forward_steps_total": ("counter", "Forwards run (decode and prefill).", sched.steps),
            "batched_tokens_total": ("counter", "Tokens those forwards decoded.", sched.batched),
            "prefill_steps_total": ("counter", "Forwards that ran prefill pieces.", sched.prefill_steps),
            "prefill_pieces_total": ("counter", "Prefill pieces those forwards ran.", sched.pieces),
        }

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

    def _take_unsaved(self) -> bool:
        """Counts a snapshot about to be staged; False if MAX_UNSAVED already wait."""
        with self._unsaved_lock:
            if self.unsaved >= MAX_UNSAVED:
                return False
            self.unsaved += 1
            return True

    def _saved(self) -> None:
        with self._unsaved_lock:
            self.unsaved -= 1

    def _save(self, staged: StagedSnapshot, label: str, prompt_tokens: int) -> None:
        """Writes a staged snapshot under its conversation's label, replacing the older snapshot of
        that conversation (`KVSnapshots.replace`): chunks are shared, so a conversation that lost
        its snapshot still finds the document's. A full disk only warns."""
        try:
            self.snapshots.replace(staged, label, {"prompt_tokens": prompt_tokens})
        except Exception as e:  # on the saver thread: nobody else would hear of it
            warnings.warn(f"could not save the snapshot: {e}", stacklevel=2)
        finally:
            self._saved()


class ContextTooLong(KVFlashError):
    pass


class Busy(KVFlashError):
    """The waiting queue is full."""


RETRY_AFTER_S = 1
"""What a refused client is told to wait (Retry-After): about one answer's time."""


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


MAX_BODY_BYTES = 8 << 20
"""Largest request body read: a 128K-token document is about 0.5 MB of JSON."""


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS = {status: {"model": ErrorBody, "description": why} for status, why in (
    (400, "A bad request: the message names the field"),
    (401, "A missing or wrong API key (a server started with --api-key)"),
    (404, "The model is not served here"),
    (413, f"The body is larger than {MAX_BODY_BYTES} bytes"),
    (429, "Too many requests wait for the engine: retry after Retry-After seconds"),
    (500, "The request failed in the engine"),
    (503, "The scheduler has stopped: the server cannot answer"),
)}  # fmt: skip
"""What the routes answer besides 200, as the OpenAPI schema declares it."""


def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None, **kw):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, **kw)


class BodyLimit:
    """Refuses a body larger than max_bytes with 413: at once when Content-Length says so, else when
    the bytes read pass it (a chunked body), before it is parsed or kept."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit():
            return await error(400, "bad Content-Length", "invalid_request_error")(scope, receive, send)
        too_large = f"the body is larger than {self.max_bytes} bytes"
        if int(length) > self.max_bytes:
            return await error(413, too_large, "invalid_request_error")(scope, receive, send)
        seen = 0

        async def counted() -> Message_:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, too_large)  # FastAPI passes HTTPExceptions through
            return message

        await self.app(scope, counted, send)


class ApiKey:
    """Every route but /health answers 401 unless the request carries `Authorization: Bearer KEY`
    (as OpenAI clients send their api_key); checked before the body is read."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                why = "a missing or wrong API key (send Authorization: Bearer <the server's --api-key>)"
                reply = error(401, why, "invalid_request_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(server: Server, max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvflash", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # added last: runs first

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            why = first.get("ctx", {}).get("error", "")
            return error(400, f"the body is not valid JSON ({why})", "invalid_request_error")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"{where or 'body'}: {first.get('msg')}", "invalid_request_error", where or None)

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.get("/health", responses={503: ERRORS[503]})
    async def health():
        if not server.scheduler.healthy:
            return error(503, f"the scheduler has stopped ({server.scheduler.failure})", "server_error")
        return {"status": "ok", "requests": server.scheduler.in_flight}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        """Prometheus's text format."""
        return server.metrics.render(server.readings())

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "kvflash"}
        return {"object": "list", "data": [card]}

    ok = {"description": "The answer, or with `stream` its server-sent events",
          "content": {"application/json": {}, "text/event-stream": {}}}  # fmt: skip

    @app.post("/v1/chat/completions", responses={200: ok, **ERRORS})
    async def chat(req: ChatRequest, request: Request):
        return await _answer(server, req, request, CHAT)

    @app.post("/v1/completions", responses={200: ok, **ERRORS})
    async def complete(req: CompletionRequest, request: Request):
        return await _answer(server, req, request, TEXT)

    return app


@dataclass(frozen=True)
class Shape:
    """How one route's answers look: the object names and a choice's text field."""

    prefix: str
    whole: str
    """The object of an unstreamed answer."""
    part: str
    """The object of a streamed chunk."""
    param: str
    """The request field a bad prompt is blamed on."""

    def choice(self, text: str, finish: str | None, first: bool = False, streamed: bool = False) -> dict:
        if self is CHAT:
            if not streamed:
                body = {"message": {"role": "assistant", "content": text}}
            else:
                body = {
                    "delta": {"role": "assistant", "content": ""}
                    if first
                    else {"content": text}
                    if text
                    else {}
                }
        else:
            body = {"text": text}
        return {"index": 0, **body, "finish_reason": finish, "logprobs": None}


CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", "messages")
TEXT = Shape("cmpl", "text_completion", "text_completion", "prompt")


async def _answer(server: Server, req: ChatRequest | CompletionRequest, request: Request, shape: Shape):
    """A request of either route: refused up front, streamed, or answered whole."""
    if req.model != server.model_name:
        server.metrics.failed("refused")
        msg = f"model {req.model!r} is not served here; this server serves {server.model_name!r}"
        return error(404, msg, "invalid_request_error", "model", "model_not_found")
    try:  # off the event loop: a long prompt takes a while to tokenise
        ids = await asyncio.to_thread(server.prompt_ids, req)
    except KVFlashError as e:
        server.metrics.failed("refused")
        code = "context_length_exceeded" if isinstance(e, ContextTooLong) else None
        return error(400, str(e), "invalid_request_error", shape.param, code)
    head = {
        "id": f"{shape.prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": server.model_name,
    }
    gone = threading.Event()
    try:
        items = _submit(server, req, ids, gone)
    except SchedulerDown as e:
        return error(503, str(e), "server_error")
    except Busy as e:
        server.metrics.failed("busy")
        return error(429, str(e), "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})
    if req.stream:
        return StreamingResponse(_stream(req, items, head, gone, shape), media_type="text/event-stream")
    watch = asyncio.create_task(_watch_disconnect(request, gone))
    try:
        while isinstance(done := await items.get(), str):
            pass
    finally:
        gone.set()  # a handler cancelled (the server stopping) ends its request too
        watch.cancel()
    if isinstance(done, SchedulerDown):
        return error(503, str(done), "server_error")
    if isinstance(done, KVFlashError):
        return error(400, str(done), "invalid_request_error")
    if isinstance(done, BaseException):
        raise done
    choice = shape.choice(done.text, done.finish_reason)
    body = {**head, "object": shape.whole, "choices": [choice], "usage": done.usage()}
    return {**body, "kvflash": done.stats.to_dict()}


async def _watch_disconnect(request: Request, gone: threading.Event) -> None:
    """Sets `gone` when the client of a non-streamed request disconnects: its request then ends at
    the next prefill piece or token instead of decoding an answer nobody reads."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _stream(
    req: ChatRequest | CompletionRequest,
    items: asyncio.Queue,
    head: dict,
    gone: threading.Event,
    shape: Shape,
) -> AsyncIterator[str]:
    """Server-sent events: (for a chat) a role chunk, one chunk per text piece, the finish chunk,
    usage if asked, then [DONE]. An error after the first byte can only be reported as an event. A
    client that disconnects cancels this generator (Starlette listens for it), which ends the request
    at its next prefill piece or token."""

    def chunk(text: str, finish: str | None = None, first: bool = False, **extra) -> str:
        choice = shape.choice(text, finish, first, streamed=True)
        return _event({**head, "object": shape.part, "choices": [choice], **extra})

    try:
        if shape is CHAT:
            yield chunk("", first=True)
        while isinstance(piece := await items.get(), str):
            yield chunk(piece)
        if isinstance(piece, BaseException):  # headers are sent: the error goes in the stream
            kind = "invalid_request_error" if isinstance(piece, KVFlashError) else "server_error"
            yield _event({"error": {"message": str(piece), "type": kind, "param": None, "code": None}})
            return
        done = piece
        yield chunk("", done.finish_reason, kvflash=done.stats.to_dict())  # the turn's stats, as unstreamed
        if req.stream_options and req.stream_options.include_usage:
            yield _event({**head, "object": shape.part, "choices": [], "usage": done.usage()})
        yield "data: [DONE]\n\n"
    finally:
        gone.set()


def _submit(
    server: Server, req: ChatRequest | CompletionRequest, ids: list[int], gone: threading.Event
) -> asyncio.Queue:
    """Queues the request; its text pieces, then its Completion or error, arrive on the queue."""
    loop, items = asyncio.get_running_loop(), asyncio.Queue()

    def emit(item: str | Completion | BaseException) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the event loop has stopped (the server is stopping): nobody listens
            pass

    server.submit(req, ids, emit, gone)
    return items


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
