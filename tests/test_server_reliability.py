"""The server under bad and hostile traffic, over real HTTP on 127.0.0.1 with the real default model:
generated requests from the OpenAPI schema, malformed and oversized bodies, clients that leave mid-
stream and mid-prefill, many requests at once. After each, the server answers the next request and
the pool, the host tier and the leases are back where they started. Marked `reliability`: `make
test-reliability` runs them."""

from __future__ import annotations

import gc
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

from kvflash.engine.paged_kv import PagedKV
from kvflash.serve.job import Job
from kvflash.serve.server import IDLE_TRIM_S, Server
from kvflash.serve.snapshots import StagedSnapshot
from kvflash.storage import ChunkBlob
from tests.test_server import DOC, JSON, MODEL, STORY, TURN1, _metric, caught_up, client, serving, settled

pytestmark = pytest.mark.reliability

MAX_EXAMPLES = 25
"""Generated requests per operation and mode: enough to cover every field's bounds in a few minutes."""


@pytest.fixture(scope="module")
def lm(smollm_path):
    from kvflash.models.loader import load_model

    return load_model(smollm_path, device="cpu")


def stray(server: Server) -> tuple[int, int, int]:
    """Pool slots, host-tier slots and store leases held by no live sequence kept for reuse: every
    request must give these back when it ends, however it ends. A slot that several live sequences
    share counts once."""
    eng, idle = server.scheduler.engine, server.scheduler.cache.idle
    chunks = [ch for kv in idle for ch in kv.seq.chunks]
    pool = eng.pool.n_used - len({ch.gpu for ch in chunks if ch.gpu is not None})
    host = eng.host.n_used - len({ch.host for ch in chunks if ch.host is not None})
    store = server.snapshots.store if server.snapshots else None
    leases = store.index.db.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0] if store else 0
    return pool, host, leases - sum(kv.fetch is not None for kv in idle)


def still_serves(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": TURN1, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_requests_generated_from_the_openapi_schema_conform_to_it(lm, tmp_path) -> None:
    """Valid and invalid requests for every operation: no 5xx, every status and body as declared,
    405 with Allow for methods not declared."""
    tried = 0
    with serving(lm, tmp_path / "store", max_tokens=2) as (url, server):
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @hypothesis.settings(
                    max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(hypothesis.HealthCheck),
                )  # fmt: skip
                @hypothesis.given(case=op.as_strategy(generation_mode=mode))
                def check(case) -> None:
                    nonlocal tried
                    tried += 1
                    case.validate_response(case.call(base_url=url, timeout=60))

                try:
                    check()
                except hypothesis.errors.Unsatisfiable:  # no input to make invalid (GET /health)
                    assert mode == GenerationMode.NEGATIVE
        settled(server)
        still_serves(url)
    print(f"schemathesis: {tried} generated requests")
    assert tried >= MAX_EXAMPLES


MALFORMED = [
    b"",
    b"{",
    b"[]",
    b"null",
    b'{"model": 1}',
    json.dumps({"model": MODEL, "messages": "hi"}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
    json.dumps({"model": MODEL, "messages": TURN1, "seed": 1.5}).encode(),
    json.dumps({"model": MODEL, "messages": TURN1, "top_p": 0}).encode(),
    json.dumps({"model": MODEL, "messages": TURN1, "temperature": float("nan")}).encode(),
    json.dumps({"model": MODEL, "messages": TURN1, "stop": ["x"] * 17}).encode(),
    b"\xff\xfe\x00garbage",
]


def test_sixty_four_requests_at_once_some_malformed(lm, tmp_path) -> None:
    """48 good requests (streamed or not, with and without a stored prefix) and 16 malformed, all at
    once: each good one answers, each bad one gets 400 or 413, then usage is back at its baseline."""
    rng = random.Random(0)
    with serving(lm, tmp_path / "store", max_tokens=4) as (url, server):
        still_serves(url)  # what the baseline includes: the model warm, one conversation stored
        settled(server)
        assert stray(server) == (0, 0, 0)
        bad = [MALFORMED[i % len(MALFORMED)] for i in range(16)]

        def question(i: int) -> list[dict]:
            return [{"role": "system", "content": DOC}, {"role": "user", "content": f"Question {i}?"}]

        good = [
            {"model": MODEL, "messages": question(i), "max_tokens": rng.randint(1, 6), "stream": i % 3 == 0,
             "temperature": rng.choice([0, 0.7])}
            for i in range(48)
        ]  # fmt: skip
        jobs = [("bad", b) for b in bad] + [("good", g) for g in good]
        rng.shuffle(jobs)

        def send(job):
            kind, payload = job
            if kind == "bad":
                return kind, httpx.post(
                    f"{url}/v1/chat/completions", content=payload, headers={"content-type": JSON}, timeout=300
                )
            return kind, httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=300)

        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(send, jobs))
        for kind, r in answers:
            if kind == "bad":
                assert r.status_code in (400, 413), r.text
                assert r.json()["error"]["message"]
            else:
                assert r.status_code == 200, r.text
                assert "error" not in r.text
        settled(server)
        caught_up(server)  # the snapshots queued so far are written
        assert stray(server) == (0, 0, 0)
        still_serves(url)


def test_clients_that_leave_mid_stream_and_mid_prefill_give_everything_back(lm, tmp_path) -> None:
    long_doc = [{"role": "system", "content": " ".join([DOC] * 40)}, {"role": "user", "content": "Who?"}]
    with serving(lm, tmp_path / "store", max_tokens=200) as (url, server):
        still_serves(url)
        settled(server)
        assert stray(server) == (0, 0, 0)
        for messages in (STORY, long_doc) * 3:
            body = {"model": MODEL, "messages": messages, "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
        for _ in range(3):  # non-streamed clients that give up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{url}/v1/chat/completions", json={"model": MODEL, "messages": long_doc}, timeout=0.3
                )
        settled(server)
        caught_up(server)  # a snapshot staged for the saver holds host slots until it is written
        assert stray(server) == (0, 0, 0)
        still_serves(url)


def test_slow_and_oversized_bodies_are_refused_and_the_server_goes_on(lm) -> None:
    with serving(lm, None, max_tokens=2, max_body_bytes=1 << 20) as (url, server):
        huge = b'{"model": "' + b"x" * (2 << 20) + b'"}'
        assert (
            httpx.post(f"{url}/v1/chat/completions", content=huge, headers={"content-type": JSON}).status_code
            == 413
        )

        def trickle():  # a slow client: a body in small pieces, past the limit
            for _ in range(40):
                time.sleep(0.01)
                yield b" " * 32768

        r = httpx.post(
            f"{url}/v1/chat/completions", content=trickle(), headers={"content-type": JSON}, timeout=60
        )
        assert r.status_code == 413
        threads = [threading.Thread(target=still_serves, args=(url,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        still_serves(url)


def test_slow_readers_and_stalled_senders_hold_up_no_one(lm, tmp_path) -> None:
    """Clients that read a streamed answer a few bytes at a time, and clients that send half a
    request and stall: other requests are answered meanwhile (the scheduler never waits on a
    socket), and once the slow clients have gone, usage is back at its baseline."""
    with serving(lm, tmp_path / "store", max_tokens=48) as (url, server):
        still_serves(url)
        settled(server)
        caught_up(server)
        assert stray(server) == (0, 0, 0)
        address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        stalled = []
        for i in range(8):  # headers promising a body that never comes, or headers cut off
            s = socket.create_connection(address)
            head = b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"mo'
            s.sendall(head if i % 2 else head[:30])
            stalled.append(s)
        readers = []
        for i in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.connect(address)
            body = json.dumps(
                {"model": MODEL, "messages": STORY, "stream": True, "seed": i, "temperature": 1.0}
            )
            s.sendall(
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: {JSON}\r\n"
                f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            assert s.recv(16).startswith(b"HTTP/1.1 200")
            readers.append(s)
        t0 = time.monotonic()
        for _ in range(3):
            still_serves(url)
        assert time.monotonic() - t0 < 120
        for s in readers:  # the slow readers read on to the end of their answers
            s.settimeout(120)
            got = b""
            while piece := s.recv(64):  # to the end: the server closes the connection
                got += piece
                time.sleep(0.002)
            assert b"data: [DONE]" in got and b'"error"' not in got
            s.close()
        for s in stalled:
            s.close()
        settled(server)
        caught_up(server)
        assert stray(server) == (0, 0, 0)
        assert server.snapshots.store.du().orphan_files == 0
        still_serves(url)


WAVES = 3
"""Waves of requests after the first; each wave is WAVE_REQUESTS at once."""
WAVE_REQUESTS = 20
RSS_SLACK = 96 << 20
"""How far the process's RSS may rise above its level after the first wave. Past that wave the
host tier is full and every kept sequence replaces an older one, and the idle server hands
malloc's free memory back (docs/RELIABILITY.md: Serving): it moved by -17 to +9 MB in the runs
here. Leaving behind a request's KV (11 MB for a ~500-token conversation) or the 5.6 MB of
summaries a sequence starts with would pass it within the waves."""


def rss() -> int:
    """This process's resident set (VmRSS), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def alive(*types: type, down_to: int | None = None, settle_s: float = 5.0) -> int:
    """Objects of exactly these types reachable after a collection in the whole process (other
    tests' module constants included); with `down_to`, once they are that few or `settle_s` has
    passed: a saver thread counts a snapshot written (`caught_up` returns) a moment before its
    frame and its executor's work item let go of it."""
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        n = sum(type(o) in types for o in gc.get_objects())
        if down_to is None or n <= down_to or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def wave_requests(wave: int) -> list[dict]:
    """WAVE_REQUESTS new conversations, each over a document of its own (~500 tokens), a fifth of
    them short chats that hold no whole chunk; every other one streamed."""
    out = []
    for i in range(WAVE_REQUESTS):
        k = wave * WAVE_REQUESTS + i
        if i % 5 == 4:
            messages = [{"role": "user", "content": f"Hi, I am visitor {k}."}]
        else:
            doc = f"Register {k}. " + " ".join(
                f"Crate {k}-{j} sits in bay {(k * 7 + j) % 97}." for j in range(40)
            )
            messages = [
                {"role": "system", "content": doc},
                {"role": "user", "content": "Which bay holds crate 3?"},
            ]
        out.append({"messages": messages, "stream": i % 2 == 1})
    return out


def test_waves_of_requests_leave_memory_where_the_first_wave_left_it(lm, tmp_path) -> None:
    """A warm-up wave, then WAVES more of WAVE_REQUESTS concurrent requests over new documents: after
    each, nothing of a finished request is left (no Job, staged snapshot or chunk copy; pool slots,
    host slots and leases held only by the live sequences kept for reuse, each of which holds a
    slot), and the process's RSS stays within RSS_SLACK of its level after the warm-up wave."""
    host_bytes = 128 << 20  # two blocks of the host tier: full after the first wave
    before = alive(Job, StagedSnapshot, ChunkBlob)  # e.g. tests/test_storage_fuzz.py's ORIGINAL
    with serving(lm, tmp_path / "store", max_tokens=4, host_bytes=host_bytes) as (url, server):
        api = client(url)

        def send(req: dict) -> str:
            kw = {"model": MODEL, "messages": req["messages"], "temperature": 0, "max_tokens": 4}
            if req["stream"]:
                return "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
                    **kw, stream=True) if c.choices)  # fmt: skip
            return api.chat.completions.create(**kw).choices[0].message.content

        levels = []
        for wave in range(1 + WAVES):
            with ThreadPoolExecutor(WAVE_REQUESTS) as pool:
                list(pool.map(send, wave_requests(wave)))  # an error answer raises here
            settled(server)
            caught_up(server)  # every snapshot written, the deferred ones too (each holds its sequence)
            cache, text = server.scheduler.cache, httpx.get(f"{url}/metrics").text
            assert _metric(text, "snapshots_unsaved") == 0
            assert 0 < _metric(text, "host_tier_bytes_allocated") <= host_bytes
            assert stray(server) == (0, 0, 0)
            assert alive(Job, StagedSnapshot, ChunkBlob, down_to=before) == before
            assert alive(PagedKV) == len(cache.idle) == len(cache._made)
            # each holds a slot, so their count is bounded (no loop variable here: it would keep
            # the last one alive into the next wave's count after the cache let it go)
            assert all(any(ch.gpu is not None or ch.host is not None for ch in kv.seq.chunks)
                       for kv in cache.idle)  # fmt: skip
            time.sleep(2 * IDLE_TRIM_S)  # the server, idle, hands malloc's free memory back
            levels.append(rss())
        print("RSS after each wave (MB):", [round(v / (1 << 20)) for v in levels])
        assert max(levels[1:]) - levels[0] <= RSS_SLACK, levels
        still_serves(url)
