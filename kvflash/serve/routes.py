"""An OpenAI-compatible HTTP server: /v1/chat/completions and /v1/completions (streamed or not) and
/v1/models over one engine, with KV reused across requests (kvflash/serve/server.py).
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were reused.

The event loop only renders prompts and relays text; the `Server`'s scheduler thread runs the
engine, and a client that goes away mid-stream ends its answer at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as Message_

from kvflash import KVFlashError
from kvflash.serve.outbox import outbox_of
from kvflash.serve.protocol import CHAT, TEXT, ChatRequest, Completion, CompletionRequest, ErrorBody, Shape
from kvflash.serve.scheduler import SchedulerDown
from kvflash.serve.server import Busy, ContextTooLong, Prompt, Server, ending

RETRY_AFTER_S = 1
"""What a refused client is told to wait (Retry-After): about one answer's time."""


MAX_BODY_BYTES = 8 << 20
"""Largest request body read: a 128K-token document is about 0.5 MB of JSON."""


ERRORS = {status: {"model": ErrorBody, "description": why} for status, why in (
    (400, "A bad request: the message names the field"),
    (401, "A missing or wrong API key (a server started with --api-key)"),
    (404, "The model is not served here"),
    (413, f"The body is larger than {MAX_BODY_BYTES} bytes"),
    (429, "Too many requests wait for the engine: retry after Retry-After seconds"),
    (500, "The request failed in the engine"),
    (503, "The scheduler has stopped, or the KV memory a request needs is in use: retry after Retry-After"),
    (504, "The request reached its time limit (--request-timeout) before its first token"),
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
        server.metrics.failed("refused")
        first = exc.errors()[0]
        kind = first.get("type")
        if kind == "json_invalid":
            why = first.get("ctx", {}).get("error", "")
            return error(400, f"the body is not valid JSON ({why})", "invalid_request_error")
        # the path into the request; pydantic's names of a union's members (`list[TextPart]`) are not
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p))
        if not where and kind in ("missing", "model_attributes_type", "dict_type"):
            return error(400, "the body must be a JSON object (Content-Type: application/json)",
                         "invalid_request_error")  # fmt: skip
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
        return server.metrics.render()

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


async def _answer(server: Server, req: ChatRequest | CompletionRequest, request: Request, shape: Shape):
    """A request of either route: refused up front, streamed, or answered whole."""
    if req.model != server.model_name:
        server.metrics.failed("refused")
        msg = f"model {req.model!r} is not served here; this server serves {server.model_name!r}"
        return error(404, msg, "invalid_request_error", "model", "model_not_found")
    try:  # off the event loop: a long prompt takes a while to tokenise
        prompt = await asyncio.to_thread(server.prompt, req)
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
        items = _submit(server, req, prompt, gone)
    except SchedulerDown as e:
        server.metrics.failed("down")
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
    if isinstance(done, KVFlashError):
        end = ending(done)
        retry = {"Retry-After": str(RETRY_AFTER_S)} if end.status == 503 else None
        return error(end.status, str(done), end.kind, headers=retry)
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

    # A text piece's event is rendered once around a placeholder and filled per piece: every token
    # of every stream passes here, on the thread the scheduler shares the interpreter with.
    before, after = chunk(TEXT_SLOT).split(json.dumps(TEXT_SLOT), 1)
    try:
        if shape is CHAT:
            yield chunk("", first=True)
        piece = await items.get()
        while isinstance(piece, str):  # the text the queue holds goes out in one write (serve/outbox.py)
            events = []
            while isinstance(piece, str):
                events.append(before + json.dumps(piece) + after)
                piece = items.get_nowait() if items.qsize() else None
            yield "".join(events)
            if piece is None:
                piece = await items.get()
        if isinstance(piece, BaseException):  # headers are sent: the error goes in the stream
            kind = ending(piece).kind
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
    server: Server, req: ChatRequest | CompletionRequest, prompt: Prompt, gone: threading.Event
) -> asyncio.Queue:
    """Queues the request; its text pieces, then its Completion or error, arrive on the queue
    (through the loop's `Outbox`: paced hand-overs for every stream, but the first text and the end
    at once)."""
    outbox, items = outbox_of(asyncio.get_running_loop()), asyncio.Queue()
    started = False

    def emit(item: str | Completion | BaseException) -> None:
        nonlocal started
        outbox.put(items, item, urgent=not (started and isinstance(item, str)))
        started = True

    server.submit(req, prompt, emit, gone)
    return items


TEXT_SLOT = "\ue000kvflash-text\ue000"
"""A placeholder no event holds but where a text piece goes (private-use characters around a name)."""


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
