"""Many users streaming from one server at once, in client processes of their own.

One Python process cannot stand in for many users: the `openai` client spends a few hundred
microseconds of interpreter time on each streamed chunk, and its threads share one GIL, so 32 streams
from one process top out at a few thousand chunks a second whatever the server does, and each
request's first chunk waits its turn behind the others' parsing. `Users` spreads the streams over
worker processes (threads within each), as separate users are: `stream` for one request each,
`map` for any function of a client (a load test's streams that each ask until a deadline). Times
are CLOCK_MONOTONIC, one clock for every process on the machine, so they compare across workers.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


def now() -> float:
    """Seconds on the clock every process of the machine shares."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Ask:
    """One streamed chat request: its messages and the exact answer length (`min_tokens` too)."""

    messages: list[dict]
    tokens: int


@dataclass
class Stream:
    """One streamed answer as its client saw it: times on `now`'s clock, server-side stats."""

    sent: float
    times: list[float] = field(default_factory=list)
    """When each content delta arrived."""
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    server_prefill_s: float = 0.0
    """The server's TTFT less the request's wait for a sequence: its restore, prefill and first token."""
    server_ttft_s: float = 0.0
    """From the request reaching the server's scheduler (its prompt tokenised) to its first token."""
    server_arrival: float = 0.0
    server_finished: float = 0.0
    """The server's clock (epoch seconds) when the request reached its scheduler and when it ended."""

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent


def stream(client, model: str, ask: Ask, shared: object = None) -> Stream:
    """One request through the `openai` client, timed as it streams."""
    s = Stream(now())
    chunks = client.chat.completions.create(
        model=model, messages=ask.messages, temperature=0, max_tokens=ask.tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"min_tokens": ask.tokens},
    )  # fmt: skip
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            s.times.append(now())
            s.text += chunk.choices[0].delta.content
        if chunk.usage:
            s.prompt_tokens, s.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            s.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
        if stats := (chunk.model_extra or {}).get("kvflash"):
            s.server_prefill_s = stats["ttft_s"] - stats["queued_s"]
            s.server_ttft_s = stats["ttft_s"]
            s.server_arrival, s.server_finished = stats["arrival_time"], stats["finished_time"]
    return s


@dataclass(frozen=True)
class Failed:
    """What a user's function raised (as text: an exception object may not pickle)."""

    error: str


def _work(conn, url: str, model: str) -> None:
    """A worker process: with its client of url and the data its `Users` shares (sent once), runs
    each batch of (function, items) it receives, one thread an item, and sends back each call's
    result or `Failed`."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600)
    conn.send("ready")
    shared = conn.recv()

    def call(fn: Callable, item):
        try:
            return fn(client, model, item, shared)
        except Exception as e:
            return Failed(f"{type(e).__name__}: {e}")

    while (batch := conn.recv()) is not None:
        fn, items = batch
        with ThreadPoolExecutor(len(items)) as pool:
            conn.send(list(pool.map(lambda item: call(fn, item), items)))  # noqa: B023 (waited for here)


def default_processes(streams: int) -> int:
    """A worker per two streams, up to half the machine's cores (the server needs the rest)."""
    return max(1, min(-(-streams // 2), (os.cpu_count() or 2) // 2))


class Users:
    """`processes` client processes, each with an `openai` client of `url` and `shared` (sent to
    each once: documents, say), started once (their imports are not timed) and reused for every
    round of requests."""

    def __init__(self, url: str, model: str, processes: int, shared: object = None):
        ctx = multiprocessing.get_context("spawn")
        self._workers = []
        for _ in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_work, args=(theirs, url, model), daemon=True)
            proc.start()
            self._workers.append((proc, mine))
        for _, conn in self._workers:
            conn.recv()
            conn.send(shared)

    def map(self, fn: Callable, items: list) -> list:
        """fn(client, model, item, shared) for every item at once, dealt round-robin over the
        workers (fn: a module-level function, which a worker imports); the results in the items'
        order. RuntimeError if any call raised."""
        n = len(self._workers)
        parts = [items[i::n] for i in range(n)]
        for (_, conn), part in zip(self._workers, parts, strict=True):
            if part:
                conn.send((fn, part))
        got: list = [None] * len(items)
        for i, ((_, conn), part) in enumerate(zip(self._workers, parts, strict=True)):
            if part:
                got[i::n] = conn.recv()
        if errors := [g.error for g in got if isinstance(g, Failed)]:
            raise RuntimeError(f"{len(errors)} of {len(items)} calls failed: {errors[0]}")
        return got

    def stream(self, asks: list[Ask]) -> list[Stream]:
        """Every ask at once (`stream`); the Streams in the asks' order."""
        return self.map(stream, asks)

    def warm(self, ask: Ask) -> None:
        """`ask` streamed once from every worker, before anything is timed: a worker's first request
        imports and builds what the `openai` client loads lazily (its resources, the streaming
        types), compiling them from source in a machine's first process, which would otherwise
        delay all but one worker's first request of a timed round."""
        self.stream([ask] * len(self._workers))

    def close(self) -> None:
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except OSError:  # it has died: nothing to tell it
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> Users:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
