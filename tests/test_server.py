"""The OpenAI-compatible server over real HTTP on 127.0.0.1, driven by the `openai` client and httpx,
with the real default model on the CPU."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflash import KVFlashError
from kvflash.cli.serve_cmd import served_name
from kvflash.config import EngineConfig
from kvflash.engine.engine import Engine
from kvflash.engine.host_tier import HostTierFull
from kvflash.engine.pool import PoolFull
from kvflash.engine.residency import chunks_of
from kvflash.models.loader import load_model
from kvflash.serve.protocol import ChatRequest, CompletionRequest, Message
from kvflash.serve.routes import create_app
from kvflash.serve.scheduler import Cancelled, SchedulerDown, TimedOut
from kvflash.serve.server import Server, StopText, conversation_label, ending
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import ChunkCorrupt, SnapshotStore

MODEL = "SmolLM2-135M-Instruct"
DOC = (
    "Harbor notes. The lighthouse of Port Elden was built by Mara Quill in 1843 and painted red in "
    "1901. The Copper Oven bakery on Tide Street is famous for its rye bread, baked before dawn. "
    "The ferry to Gull Island leaves at nine each morning and returns at four."
)
JSON = "application/json"
TURN1 = [{"role": "system", "content": DOC}, {"role": "user", "content": "Who built the lighthouse?"}]


@pytest.fixture(scope="module")
def lm(smollm_path):
    return load_model(smollm_path, device="cpu")


@contextmanager
def serving(
    lm,
    store: Path | object | None,
    max_tokens: int = 16,
    max_prompt_tokens: int | None = None,
    max_batch: int = 4,
    max_waiting: int = 256,
    host_bytes: int = EngineConfig.host_bytes,
    request_timeout: float | None = None,
    sequence_tokens: int | None = None,
    **app,
) -> Iterator[tuple[str, Server]]:
    """A server on a free port of 127.0.0.1, in a thread of this process, over a new engine whose
    pool (4,096 tokens) the requests share by room (up to `max_batch` together). `store` is a
    directory (a store opened and closed here) or a store the caller opened (and closes)."""
    engine = Engine(lm, EngineConfig(pool_tokens=4096, host_bytes=host_bytes))
    st = SnapshotStore(store) if isinstance(store, Path) else store
    snapshots = KVSnapshots(st, engine.fingerprint) if st else None
    server = Server(engine, lm.tokenizer, MODEL, snapshots, max_tokens, max_batch, max_prompt_tokens,
                    max_waiting, sequence_tokens, request_timeout)  # fmt: skip
    config = uvicorn.Config(create_app(server, **app), host="127.0.0.1", port=0, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(30)
        server.close()
        if isinstance(store, Path):
            st.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(url: str, messages: list[dict], **kw):
    return client(url).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def test_a_conversation_reuses_its_kv_from_memory_and_after_a_restart_from_disk(lm, tmp_path) -> None:
    store = tmp_path / "store"
    with serving(lm, store) as (url, _):
        first = ask(url, TURN1)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        reply = first.choices[0].message.content
        assert reply and first.model == MODEL
        turn2 = [
            *TURN1,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the bakery?"},
        ]
        live = ask(url, turn2)
    assert live.model_extra["kvflash"]["source"] == "memory"
    assert live.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    with serving(lm, store) as (url, server):  # a restarted server: the snapshot is all it has
        restored = ask(url, turn2)
        deadline = time.monotonic() + 60
        while server.unsaved:  # the saver thread writes the turn's snapshot after the answer
            assert time.monotonic() < deadline, "the snapshot was never written"
            time.sleep(0.05)
        text = httpx.get(f"{url}/metrics").text
    assert restored.model_extra["kvflash"]["source"] in ("disk", "lazy")
    read = restored.model_extra["kvflash"]["bytes_moved"]["disk"]
    assert read > 0 and _metric(text, 'bytes_moved_total{tier="disk"}') == read
    assert _metric(text, 'snapshot_saves_total{outcome="saved"}') == 1
    assert restored.usage.prompt_tokens_details.cached_tokens >= 64
    with serving(lm, None) as (url, _):
        cold = ask(url, turn2)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    answers = {r.choices[0].message.content for r in (live, restored, cold)}
    assert len(answers) == 1, answers  # reused KV answers as a cold prefill does
    assert live.usage.prompt_tokens == restored.usage.prompt_tokens == cold.usage.prompt_tokens


def hold_writes(monkeypatch) -> threading.Event:
    """Holds every snapshot write of the store until the event it returns is set."""
    release, real = threading.Event(), SnapshotStore.put_snapshot

    def held(self, *args, **kw):
        assert release.wait(60), "the write was never let go"
        return real(self, *args, **kw)

    monkeypatch.setattr(SnapshotStore, "put_snapshot", held)
    return release


def until(condition, timeout: float = 30) -> bool:
    """Whether `condition()` holds within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def caught_up(server, timeout: float = 60) -> None:
    """Waits until no snapshot is staged or deferred."""
    deadline = time.monotonic() + timeout
    while (server.unsaved or server._deferred) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.unsaved and not server._deferred


def test_the_next_request_does_not_wait_for_the_last_ones_snapshot(lm, tmp_path, monkeypatch) -> None:
    """Snapshots are written by the saver thread: with the store's writes held back, the next turn
    is still answered (from the live sequence; were the write in its way, it would wait the minute
    the write is held and time out), and both snapshots land once the writes go on."""
    release = hold_writes(monkeypatch)
    with serving(lm, tmp_path / "store") as (url, server):
        try:
            reply = ask(url, TURN1).choices[0].message.content
            more = [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the ferry?"}]
            second = ask(url, TURN1 + more, timeout=20)
            assert second.usage.prompt_tokens_details.cached_tokens > 0
            assert not server.snapshots.store.list_snapshots()  # both writes still held
        finally:
            release.set()
    with SnapshotStore(tmp_path / "store") as st:
        (snap,) = st.list_snapshots()  # the second replaced the first
        assert snap.meta["prompt_tokens"] == second.usage.prompt_tokens


def test_snapshots_waiting_for_the_disk_are_bounded_and_the_rest_catch_up(lm, tmp_path, monkeypatch) -> None:
    """Each staged snapshot holds a copy of its KV: with the store's writes held back, seven answers
    stage at most MAX_UNSAVED snapshots and are all answered; the other three are deferred, and
    staged from their live sequences once the writes go on, so every conversation is saved."""
    from kvflash.serve.server import MAX_UNSAVED

    release = hold_writes(monkeypatch)
    with serving(lm, tmp_path / "store", max_tokens=2) as (url, server):
        try:
            for i in range(7):
                conv = [{"role": "system", "content": DOC}, {"role": "user", "content": f"Question {i}?"}]
                assert ask(url, conv, timeout=30).choices[0].message.content is not None
            # the answer is out before its snapshot is staged (or deferred)
            assert until(lambda: len(server._deferred) == 7 - MAX_UNSAVED) and server.unsaved == MAX_UNSAVED
        finally:
            release.set()
        caught_up(server)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvflash_snapshot_saves_total{outcome="deferred"} 3.0' in metrics
        assert 'kvflash_snapshot_saves_total{outcome="saved"} 7.0' in metrics
    with SnapshotStore(tmp_path / "store") as st:
        assert len(st.list_snapshots()) == 7


def test_a_deferred_snapshot_whose_conversation_went_on_is_left_to_its_next_turn(
    lm, tmp_path, monkeypatch
) -> None:
    """An answer deferred while the writes are behind, whose conversation asks again before they
    catch up, is not staged from the sequence its next turn took: the next turn saves it (once)."""
    from kvflash.serve.server import MAX_UNSAVED

    release = hold_writes(monkeypatch)
    with serving(lm, tmp_path / "store", max_tokens=2) as (url, server):
        convs = [[{"role": "system", "content": DOC}, {"role": "user", "content": f"Question {i}?"}]
                 for i in range(MAX_UNSAVED + 1)]  # fmt: skip
        try:
            answers = [ask(url, c, timeout=30).choices[0].message.content for c in convs]
            assert until(lambda: len(server._deferred) == 1)  # the last conversation's
            convs[-1] += [{"role": "assistant", "content": answers[-1]}, {"role": "user", "content": "And?"}]
            again = ask(url, convs[-1], timeout=30).usage
            assert again.prompt_tokens_details.cached_tokens > 0  # its live sequence went on
            # its newer answer replaced the older
            deferred = lambda: [d.prompt_tokens for d in server._deferred.values()]  # noqa: E731
            assert until(lambda: deferred() == [again.prompt_tokens])
        finally:
            release.set()
        caught_up(server)
    with SnapshotStore(tmp_path / "store") as st:
        assert len(st.list_snapshots()) == MAX_UNSAVED + 1


def test_a_deferred_snapshot_whose_sequence_another_conversation_took_is_not_saved_as_its_own(
    lm, tmp_path, monkeypatch
) -> None:
    """Conversation A's answer is deferred (the writes are behind); B, over the same document past
    the sequence budget, takes A's live sequence (cut back to the chunks they share) and is answered
    and deferred too. Once the writes go on, A's label is not given B's KV: only B's snapshot holds
    B's question."""
    from kvflash.serve.server import MAX_UNSAVED

    release = hold_writes(monkeypatch)
    doc = " ".join([DOC] * 12)  # well past the 512-token budget: the sequences evict
    qb = " ".join(f"Question {i}: what did the ferry carry across the bay in winter {i}?" for i in range(12))
    a = [{"role": "system", "content": doc}, {"role": "user", "content": "Who built it?"}]
    b = [{"role": "system", "content": doc}, {"role": "user", "content": qb}]
    with serving(lm, tmp_path / "store", max_tokens=2, sequence_tokens=512) as (url, server):
        try:
            for i in range(MAX_UNSAVED):  # the saver's places taken
                note = [{"role": "system", "content": f"Note {i}: " + DOC}, {"role": "user", "content": "?"}]
                ask(url, note)
            assert until(lambda: server.unsaved == MAX_UNSAVED)
            ask(url, a)
            assert until(lambda: len(server._deferred) == 1)
            (deferred_a,) = server._deferred.values()
            assert ask(url, b).usage.prompt_tokens_details.cached_tokens > 0
            assert until(lambda: len(server._deferred) == 2)
            assert all(d.kv is deferred_a.kv for d in server._deferred.values())  # B took A's sequence
        finally:
            release.set()
        caught_up(server)
        store, q = server.snapshots.store, lm.tokenizer.encode_plain(qb)[:64]  # sealed whatever the tail
        holds_b = {}
        for snap in store.list_snapshots():
            blobs = store.read_chunks_parallel(store.get_snapshot(snap.id).chunk_hashes, snap.fingerprint)
            ids = [t for blob in blobs for t in blob.tokens]
            holds_b[snap.label] = any(ids[i : i + len(q)] == q for i in range(len(ids)))
    label = {name: conversation_label([Message(**m) for m in conv]) for name, conv in (("a", a), ("b", b))}
    assert holds_b[label["b"]] and not holds_b.get(label["a"]), holds_b


def test_requests_in_flight_have_host_memory_pinned_for_all_their_snapshots(lm, tmp_path) -> None:
    """Four conversations over distinct documents at once: the host tier is grown ahead for all
    four snapshots together (more chunks than one block of the tier), not for each request's own
    beside what the tier already held, so each stages into free host slots; once all have staged
    none is still counted as about to."""
    from kvflash.engine.host_tier import BLOCK_SLOTS

    docs = [f"Ledger {i}. " + DOC * 18 for i in range(4)]
    convs = [[{"role": "system", "content": d}, {"role": "user", "content": "Who built it?"}] for d in docs]
    with serving(lm, tmp_path / "store", max_tokens=2) as (url, server):
        with ThreadPoolExecutor(len(convs)) as pool:
            got = list(pool.map(lambda c: ask(url, c), convs))
        host = server.scheduler.engine.host
        chunks = sum(r.usage.prompt_tokens // 64 for r in got)
        assert chunks > BLOCK_SLOTS
        assert host.n_allocated >= chunks
        deadline = time.monotonic() + 30  # the last answer is out before its snapshot is staged
        while server._staging and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server._staging == 0


def test_a_burst_while_the_last_bursts_snapshots_wait_for_the_disk_grows_no_second_staging_room(
    lm, tmp_path, monkeypatch
) -> None:
    """MAX_UNSAVED conversations over distinct documents stage their snapshots and their writes are
    held; their next turns come while those still wait. No more than MAX_UNSAVED snapshots are
    staged at once, so the room the first turns grew the host tier for is all the second turns
    will stage into: the tier does not grow again (pinning, page by page, memory no snapshot uses)."""
    from kvflash.serve.server import MAX_UNSAVED

    release = hold_writes(monkeypatch)
    docs = [f"Ledger {i}. " + DOC * 12 for i in range(MAX_UNSAVED)]
    convs = [[{"role": "system", "content": d}, {"role": "user", "content": "Who built it?"}] for d in docs]
    with serving(lm, tmp_path / "store", max_tokens=2) as (url, server):
        host = server.scheduler.engine.host
        try:
            with ThreadPoolExecutor(len(convs)) as pool:
                answers = list(pool.map(lambda c: ask(url, c).choices[0].message.content, convs))
            assert until(lambda: server.unsaved == MAX_UNSAVED and not server._staging)
            assert until(lambda: not host._growing)
            grown = host.n_allocated
            for conv, answer in zip(convs, answers, strict=True):
                conv += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And when?"}]
            with ThreadPoolExecutor(len(convs)) as pool:
                again = list(pool.map(lambda c: ask(url, c).usage, convs))
            assert all(u.prompt_tokens_details.cached_tokens > 0 for u in again)
            assert until(lambda: not server._staging and not host._growing)
            assert host.n_allocated == grown, (grown, host.n_allocated, [u.prompt_tokens for u in again])
        finally:
            release.set()
        caught_up(server)
        assert server._staged_slots == 0


def test_streamed_deltas_make_the_whole_answer(lm) -> None:
    with serving(lm, None, max_tokens=24) as (url, _):
        whole = ask(url, TURN1)
        chunks = list(ask(url, TURN1, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(deltas) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_end_the_answer_before_them(lm) -> None:
    with serving(lm, None, max_tokens=24) as (url, _):
        whole = ask(url, TURN1).choices[0].message.content
        words = whole.split()
        assert len(words) >= 4, whole
        stop = " " + words[3]
        cut = ask(url, TURN1, stop=[stop, "never appears"])
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(url, TURN1, stop=stop, stream=True))
    assert cut.choices[0].message.content == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert streamed == cut.choices[0].message.content


def test_max_tokens_ends_the_answer_with_length(lm) -> None:
    with serving(lm, None) as (url, _):
        r = ask(url, TURN1, max_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_min_tokens_holds_the_end_of_sequence_back(lm) -> None:
    hi = [{"role": "user", "content": "Say hi."}]
    with serving(lm, None, max_tokens=64) as (url, _):
        free = ask(url, hi)
        n = free.usage.completion_tokens
        assert free.choices[0].finish_reason == "stop" and n < 40, "the greedy answer should end early"
        held = ask(url, hi, extra_body={"min_tokens": n + 8})
    assert held.usage.completion_tokens >= n + 8
    assert held.choices[0].message.content.startswith(free.choices[0].message.content)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text("ab c", min_size=1, max_size=7), min_size=1, max_size=3),
    st.lists(st.text("ab c", max_size=4), max_size=8),
)
def test_stop_text_holds_back_exactly_the_longest_start_of_a_stop_string(stops, pieces) -> None:
    """What is held back is the longest end of the text that begins some stop string (checked against
    every prefix of every stop, as the definition reads), and what is sent is never taken back."""
    s, sent = StopText(stops), ""
    for piece in pieces:
        sent += s.push(piece)
        if s.stopped:
            break
        held = max((k for t in stops for k in range(1, len(t)) if s.text.endswith(t[:k])), default=0)
        assert sent == s.text[: len(s.text) - held]
    assert sent + s.flush() == s.text and not any(t in s.text for t in stops)


def test_stop_text_holds_back_what_may_begin_a_stop_string() -> None:
    s = StopText(["END", "xy"])
    assert s.push("abc E") == "abc "  # "E" may begin "END"
    assert s.push("N") == ""
    assert s.push("Dzzz") == "" and s.stopped and s.text == "abc "
    s = StopText(["END"])
    assert s.push("E") == "" and s.push("Nx") == "ENx" and not s.stopped
    assert s.push("ab") + s.flush() == "ab"
    s = StopText(["b", "abc"])
    assert s.push("xabc") == "x" and s.stopped  # the stop that begins first wins


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": TURN1, **fields}).encode()


IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
SURROGATE = [{"role": "user", "content": "\ud800"}]  # json.dumps writes it as the escape \ud800
BAD = [
    (body(seed=1.5), 400, "seed"),
    (body(stop=[f"s{i}" for i in range(1000)]), 400, "stop"),
    (body(stop="x" * 10_000), 400, "stop"),
    (body(messages=SURROGATE), 400, "messages.0.content"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "a\udfff"}]}]), 400, "messages.0"),
    (body(stop=["\ud800"]), 400, "stop"),
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (body(messages=[]), 400, "messages"),
    (body(n=2), 400, "n"),
    (body(max_tokens=0), 400, "max_tokens"),
    (body(temperature=9), 400, "temperature"),
    (body(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0"),
    (body(messages=IMAGE), 400, "messages.0"),
    (body(model="gpt-9"), 404, "model"),
    (body(stream="yes"), 400, "stream"),
    (body(max_tokens="5"), 400, "max_tokens"),
    (body(max_tokens=5.5), 400, "max_tokens"),
    (body(temperature=float("nan")), 400, "temperature"),
]

NAMED = [  # (body, content type, the param named exactly, words of the message)
    (body(messages=[{"role": "user", "content": None}]), JSON, "messages.0.content", "valid string"),
    (body(temperature=float("nan")), JSON, "temperature", "finite number"),
    (b"hello", "text/plain", None, "must be a JSON object"),
    (b"", JSON, None, "must be a JSON object"),
    (b"[1, 2]", JSON, None, "must be a JSON object"),
]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(lm) -> None:
    with serving(lm, None, max_tokens=2) as (url, _):
        for body, status, param in BAD:
            r = httpx.post(
                f"{url}/v1/chat/completions", content=body, headers={"content-type": JSON}, timeout=30
            )
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], r.text
            assert param is None or (err["param"] or "").startswith(param), (param, err)
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client(url).chat.completions.create(model="gpt-9", messages=TURN1)
        assert httpx.get(f"{url}/v1/nothing").json()["error"]["message"] == "Not Found"
        assert [m.id for m in client(url).models.list()] == [MODEL]
        assert ask(url, TURN1).choices[0].message.content
        whole = post(url, messages=TURN1, max_tokens=2.0, seed=7.0)
        assert whole.status_code == 200, whole.text  # JSON Schema's integers: 2.0 is one


NOT_DONE = [  # (route, a field asking for what kvflash does not do)
    ("chat/completions", {"logprobs": True}),
    ("chat/completions", {"top_logprobs": 2}),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "lookup"}}]}),
    ("chat/completions", {"tool_choice": "required"}),
    ("chat/completions", {"response_format": {"type": "json_object"}}),
    ("completions", {"logprobs": 1}),
    ("completions", {"echo": True}),
    ("completions", {"best_of": 2}),
    ("completions", {"suffix": "The end."}),
]


def test_a_field_asking_for_what_kvflash_does_not_do_is_refused_by_name(lm) -> None:
    """An answer without the log probabilities, tool calls or JSON it was asked for would look like
    one that has them to a client that does not check; the same fields asking for nothing are
    taken (as clients send them)."""
    with serving(lm, None, max_tokens=2) as (url, _):
        for route, field in NOT_DONE:
            what = {"messages": TURN1} if route.startswith("chat") else {"prompt": DOC}
            r = httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **what, **field}, timeout=30)
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert [err["param"]] == list(field) and "kvflash" in err["message"], err
        answer = client(url).chat.completions.create(
            model=MODEL, messages=TURN1, max_tokens=2, temperature=0, logprobs=False, tools=[],
            tool_choice="none", response_format={"type": "text"},
        )  # fmt: skip
        assert answer.choices[0].message.content
        text = client(url).completions.create(
            model=MODEL, prompt=DOC, max_tokens=2, temperature=0, echo=False, best_of=1
        )
        assert text.choices[0].text


def test_a_bad_field_is_named_as_the_request_spells_it(lm) -> None:
    with serving(lm, None, max_tokens=2) as (url, _):
        for content, kind, param, words in NAMED:
            r = httpx.post(f"{url}/v1/chat/completions", content=content, headers={"content-type": kind})
            assert r.status_code == 400, (content, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (content, err)


def test_concurrent_requests_get_the_answers_they_get_alone(lm, tmp_path) -> None:
    questions = ["Who built the lighthouse?", "When does the ferry leave?", "What is the bakery famous for?"]
    convs = [[{"role": "system", "content": DOC}, {"role": "user", "content": q}] for q in questions]
    with serving(lm, tmp_path / "store") as (url, _):
        alone = [ask(url, c).choices[0].message.content for c in convs]
        with ThreadPoolExecutor(len(convs)) as pool:
            together = list(pool.map(lambda c: ask(url, c).choices[0].message.content, convs))
    assert together == alone


STORY = [{"role": "system", "content": DOC}, {"role": "user", "content": "Tell a long story about Mara."}]


def test_a_client_that_leaves_mid_stream_ends_its_answer(lm) -> None:
    story = STORY
    body = {"model": MODEL, "messages": story, "temperature": 0, "max_tokens": 80, "stream": True}
    with serving(lm, None) as (url, server):
        whole = ask(url, story, max_tokens=80).usage.completion_tokens
        assert whole > 20, "the story must be long enough to leave in the middle of"
        ask(url, TURN1, max_tokens=1)  # the live sequence is another conversation's now
        ids = server.prompt(ChatRequest(model=MODEL, messages=story)).ids
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():  # leaves at the first text: the answer has begun
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
        settled(server)  # the streamed answer ends; its sequence is kept live with what it had
        kept = [kv for kv in server.scheduler.cache.idle if kv.seq.tokens[: len(ids)] == ids]
        assert len(kept) == 2  # the first answer's sequence, and the one sharing its chunks, kept last
        generated = len(kept[-1].seq) - len(ids)
        assert ask(url, TURN1, max_tokens=2).choices[0].message.content
    assert 0 <= generated < whole - 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(smollm_path: Path, store: Path, *flags: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`kvflash serve` in a process of its own, on a free port, once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvflash.cli.app", "serve", "--model", str(smollm_path), "--device", "cpu",
           "--port", str(port), "--store", str(store), *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "kvflash serve did not come up"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_server_answers_to_its_models_name_dots_and_all(tmp_path) -> None:
    """`--served-model-name` by default: a GGUF's file name up to its quantisation, an HF
    directory's name as it is (`Qwen2.5-7B-Instruct` was served as `Qwen2`)."""
    (hf := tmp_path / "Qwen2.5-7B-Instruct").mkdir()
    assert served_name(hf) == "Qwen2.5-7B-Instruct"
    for file, name in (
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Qwen2.5-7B-Instruct.Q4_K_M.gguf", "Qwen2.5-7B-Instruct"),
        ("Llama-3.1-8B.gguf", "Llama-3.1-8B"),
        ("Llama-3.1-8B.BF16.gguf", "Llama-3.1-8B"),
    ):
        assert served_name(tmp_path / file) == name


def test_serve_command_answers_and_stops_cleanly(smollm_path, tmp_path) -> None:
    store = tmp_path / "store"
    with serve_process(smollm_path, store, "--max-tokens", "4") as (url, proc):
        r = ask(url, TURN1)
        assert 1 <= r.usage.completion_tokens <= 4
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    with SnapshotStore(store) as st:
        assert [s.label.startswith("serve:") for s in st.list_snapshots()] == [True]


def test_sigterm_stops_a_server_with_a_request_in_flight(smollm_path, tmp_path) -> None:
    """A request that would decode for minutes: SIGTERM ends it after the grace period, its answer's
    snapshot is written, and the process exits."""
    store = tmp_path / "store"
    with serve_process(smollm_path, store, "--max-tokens", "100000") as (url, proc):
        body = {"model": MODEL, "messages": STORY, "stream": True, "temperature": 1.0, "seed": 1}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            out, _ = proc.communicate(timeout=60)
            stopped = time.monotonic() - t0
    assert proc.returncode == 0, out
    assert stopped < 30, stopped
    with SnapshotStore(store) as st:
        assert len(st.list_snapshots()) == 1


def post(url: str, timeout: float = 60, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, **fields}, timeout=timeout)


def settled(server: Server, timeout: float = 60) -> None:
    """Waits until the scheduler holds no request."""
    deadline = time.monotonic() + timeout
    while server.scheduler.in_flight:
        assert time.monotonic() < deadline, "a request never ended"
        time.sleep(0.05)


def test_a_tiny_temperature_or_top_p_samples_as_greedy_decoding(lm) -> None:
    with serving(lm, None, max_tokens=8) as (url, _):
        greedy = post(url, messages=TURN1, temperature=0).json()["choices"][0]["message"]["content"]
        for fields in ({"temperature": 1e-300}, {"top_p": 1e-300}, {"temperature": 5e-324, "top_p": 1e-45}):
            r = post(url, messages=TURN1, seed=1, **fields)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == greedy


def test_a_seed_is_any_integer_taken_modulo_2_to_the_64(lm) -> None:
    """Seeds 2**64 apart sample one answer; other seeds others."""
    with serving(lm, None, max_tokens=8) as (url, _):

        def sampled(seed: int) -> str:
            r = post(url, messages=TURN1, temperature=1.0, seed=seed)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        same = {sampled(seed) for seed in (5, 5 + 2**64, 5 - 2**64, 5 + 2**200)}
        others = {sampled(seed) for seed in (6, 7, 8)}
    assert len(same) == 1 and others - same, (same, others)


def test_an_answer_that_would_not_fit_after_its_prompt_is_refused_up_front(lm) -> None:
    """max_tokens past what one sequence holds after the prompt is a 400 before the engine runs
    (not an error after the answer decoded that far); an answer of no asked length takes the
    server's default up to that room; a text completion's default is OpenAI's 16."""
    with serving(lm, None, max_tokens=1 << 30, max_prompt_tokens=3000) as (url, server):
        most = server.scheduler.max_context_tokens
        n = len(server.prompt(ChatRequest(model=MODEL, messages=TURN1)).ids)
        for route, fields in (("chat/completions", {"messages": TURN1}), ("completions", {"prompt": DOC})):
            fields = {"model": MODEL, "max_tokens": most, **fields}
            r = httpx.post(f"{url}/v1/{route}", json=fields, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "context_length_exceeded" and f"holds at most {most}" in err["message"]
        assert server.prompt(ChatRequest(model=MODEL, messages=TURN1)).max_tokens == most - n
        asked = ChatRequest(model=MODEL, messages=TURN1, max_tokens=most - n)
        assert server.prompt(asked).max_tokens == most - n
        assert server.prompt(CompletionRequest(model=MODEL, prompt=DOC, max_tokens=None)).max_tokens == 16
        assert _metric(httpx.get(f"{url}/metrics").text, 'requests_total{outcome="refused"}') == 2


def test_what_ends_a_request_in_the_engine_is_the_servers_to_answer_for() -> None:
    """A request's own faults are refused before the engine (400); what ends one there is a stopped
    scheduler or KV memory others hold (503, retry), its time limit (504) or a failure (500), and
    /metrics counts each as what it answered."""
    for e, want in (
        (SchedulerDown("stopped"), (503, "server_error", "down")),
        (HostTierFull("full"), (503, "server_error", "full")),
        (PoolFull("full"), (503, "server_error", "full")),
        (TimedOut("late"), (504, "timeout_error", "timeout")),
        (Cancelled("gone"), (500, "server_error", "cancelled")),
        (ChunkCorrupt("ab" * 32, "bad"), (500, "server_error", "error")),
        (KVFlashError("a step needs more chunks than the budget"), (500, "server_error", "error")),
    ):
        end = ending(e)
        assert (end.status, end.kind, end.outcome) == want, e


def test_a_prompt_over_the_limit_is_refused_up_front(lm) -> None:
    with serving(lm, None, max_prompt_tokens=64) as (url, _):
        r = post(url, messages=TURN1)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "context too long" in err["message"]
        assert "--max-prompt-tokens" in err["message"]
        assert post(url, messages=[{"role": "user", "content": "Hi"}], max_tokens=2).status_code == 200


def test_bodies_over_the_limit_get_413_before_they_are_read(lm) -> None:
    limit = 1 << 16
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * limit}]}).encode()
    with serving(lm, None, max_body_bytes=limit) as (url, _):
        sized = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": JSON})
        chunked = httpx.post(  # no Content-Length: counted as it is read
            f"{url}/v1/chat/completions",
            content=iter([big[:1000], big[1000:]]),
            headers={"content-type": JSON},
        )
        for r in (sized, chunked):
            assert r.status_code == 413, r.text
            assert "larger than" in r.json()["error"]["message"]
        assert post(url, messages=TURN1, max_tokens=2).status_code == 200


def test_undeclared_methods_get_405_naming_the_allowed_one(lm) -> None:
    with serving(lm, None) as (url, _):
        for method in ("GET", "DELETE", "PUT"):
            r = httpx.request(method, f"{url}/v1/chat/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST", (method, r.headers)
        assert httpx.post(f"{url}/health").headers["allow"] == "GET"


def test_a_non_streamed_client_that_leaves_ends_its_request(lm) -> None:
    """A client that gives up on a non-streamed answer: its request ends at the next token, not at
    max_tokens (the sequence is kept live with the tokens it had)."""
    with serving(lm, None) as (url, server):
        whole = post(url, messages=STORY, temperature=0, max_tokens=80).json()["usage"]["completion_tokens"]
        assert whole > 20, "the story must be long enough to leave in the middle of"
        post(url, messages=TURN1, max_tokens=1)  # the live sequence is another conversation's now
        ids = server.prompt(ChatRequest(model=MODEL, messages=STORY)).ids
        before = list(server.scheduler.cache.idle)
        with pytest.raises(httpx.ReadTimeout):
            post(url, timeout=0.5, messages=STORY, temperature=0, max_tokens=80)
        settled(server)
        kept = [kv for kv in server.scheduler.cache.idle if not any(kv is b for b in before)]
        assert all(len(kv.seq) - len(ids) < whole - 1 for kv in kept), [len(kv.seq) - len(ids) for kv in kept]
        assert post(url, messages=TURN1, max_tokens=2).status_code == 200
        assert _metric(httpx.get(f"{url}/metrics").text, 'requests_total{outcome="cancelled"}') == 1


def test_a_streamed_client_that_leaves_mid_prefill_ends_it_before_its_first_token(lm) -> None:
    """A prompt of some 3,000 tokens prefills in 512-token pieces; its client leaves as soon as the
    role chunk arrives. The request ends at the next piece: no answer, no live sequence kept."""
    long_doc = [{"role": "system", "content": " ".join([DOC] * 40)}, {"role": "user", "content": "Who?"}]
    body = {"model": MODEL, "messages": long_doc, "max_tokens": 4, "stream": True}
    with serving(lm, None) as (url, server):
        ids = server.prompt(ChatRequest(model=MODEL, messages=long_doc)).ids
        assert len(ids) > 2500
        t0 = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        settled(server)
        ended = time.monotonic() - t0
        assert not [kv for kv in server.scheduler.cache.idle if kv.seq.tokens[:64] == ids[:64]]
        assert server.scheduler.engine.pool.n_free == server.scheduler.engine.pool.n_slots
        t0 = time.monotonic()
        post(url, messages=long_doc, max_tokens=1)  # the whole prefill, for scale
        whole = time.monotonic() - t0
    assert ended < whole, (ended, whole)


def test_health_and_new_requests_say_503_once_the_scheduler_has_stopped(lm) -> None:
    """The scheduler's thread stopped by a callback that raises past every handler (SystemExit):
    /health turns unhealthy, and requests are refused with 503 instead of hanging."""
    from kvflash.engine.generate import Sampling
    from kvflash.serve.job import Job

    def die(tok: int) -> bool:
        raise SystemExit("stopped")

    with serving(lm, None) as (url, server):
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        ids = server.prompt(ChatRequest(model=MODEL, messages=TURN1)).ids
        errors: list[BaseException] = []
        server.scheduler.submit(Job(ids, 4, Sampling(), die, lambda *a: None, errors.append))
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{url}/health")).status_code == 200:
            assert time.monotonic() < deadline, "the scheduler never reported its failure"
            time.sleep(0.05)
        assert health.status_code == 503 and "stopped" in health.json()["error"]["message"]
        r = post(url, timeout=10, messages=TURN1)
        assert r.status_code == 503, r.text
        streamed = httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": TURN1, "stream": True}
        )
        assert streamed.status_code == 503
        assert errors and "stopped" in str(errors[0])


def test_two_conversations_over_one_document_keep_their_own_snapshots(lm, tmp_path) -> None:
    """Each conversation's snapshot is its own (labelled by its first messages), so after a restart
    each restores its whole prefix, not the other's document prefix alone."""
    store = tmp_path / "store"
    convs = [[{"role": "system", "content": DOC}, {"role": "user", "content": q}] for q in ("Who?", "When?")]
    with serving(lm, store) as (url, _):
        grown = []
        for conv in convs:
            reply = ask(url, conv).choices[0].message.content
            grown.append(
                [*conv, {"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
            )
    with SnapshotStore(store) as st:
        assert len({s.label for s in st.list_snapshots()}) == 2
    with serving(lm, store) as (url, _):
        for conv in grown:
            r = ask(url, conv)
            assert r.usage.prompt_tokens_details.cached_tokens >= (r.usage.prompt_tokens - 16) // 64 * 64 - 64


def _metric(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"kvflash_{name} ")]
    return float(line.split()[1])


def test_metrics_count_requests_tokens_and_pool_use(lm) -> None:
    with serving(lm, None) as (url, server):
        before = httpx.get(f"{url}/metrics").text
        assert _metric(before, "pool_slots_used") == 0 and 'outcome="stop"' not in before
        first = ask(url, TURN1, max_tokens=4)
        second = ask(url, [*TURN1, {"role": "assistant", "content": first.choices[0].message.content},
                           {"role": "user", "content": "When?"}], max_tokens=4)  # fmt: skip
        with pytest.raises(openai.NotFoundError):  # refused: no such model here
            client(url).chat.completions.create(model="nope", messages=TURN1)
        assert post(url, messages=TURN1, temperature="hot").status_code == 400  # refused: a bad field
        text = httpx.get(f"{url}/metrics").text
        steps, prefill_steps = server.scheduler.steps, server.scheduler.prefill_steps
    kinds = [k for k in ("decode", "mixed", "prefill") if f'step_seconds_count{{kind="{k}"}}' in text]
    counts = {k: _metric(text, f'step_seconds_count{{kind="{k}"}}') for k in kinds}
    assert sum(counts.values()) == steps and counts.get("decode", 0) > 0  # every step, each once
    assert counts.get("mixed", 0) + counts.get("prefill", 0) == prefill_steps
    for k in kinds:  # a step's wait for the device is part of its time
        assert (
            0
            <= _metric(text, f'step_wait_seconds_sum{{kind="{k}"}}')
            <= _metric(text, f'step_seconds_sum{{kind="{k}"}}')
        )
    done = sum(
        _metric(text, f'requests_total{{outcome="{o}"}}') for o in ("stop", "length") if f'"{o}"' in text
    )
    assert done == 2 and _metric(text, 'requests_total{outcome="refused"}') == 2
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused > 0 and _metric(text, 'tokens_total{kind="memory"}') == reused
    generated = first.usage.completion_tokens + second.usage.completion_tokens
    assert _metric(text, 'tokens_total{kind="generated"}') == generated
    assert _metric(text, "ttft_seconds_count") == 2
    assert _metric(text, "inter_token_seconds_count") == generated - 2  # the gaps after each first token
    assert _metric(text, "live_sequences") >= 1 and _metric(text, "pool_slots_used") > 0
    assert _metric(text, "pool_slots_idle") == _metric(text, "pool_slots_used")  # nothing else holds one
    assert _metric(before, "pool_slots_idle") == 0 == _metric(text, "host_tier_slots_idle")
    assert _metric(text, "requests_waiting") == 0 and _metric(text, "evicted_chunks_total") == 0


def test_an_api_key_is_required_everywhere_but_health(lm) -> None:
    with serving(lm, None, api_key="s3cret") as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{url}{path}")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            ask(url, TURN1, max_tokens=2)
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=120)
        reply = keyed.chat.completions.create(model=MODEL, messages=TURN1, temperature=0, max_tokens=2)
        assert reply.choices[0].message.content is not None


def test_past_the_waiting_queue_a_request_gets_429_with_retry_after(lm) -> None:
    """One request decoding, one waiting for the only batch slot: a third is refused at once with
    429 and Retry-After, and the other two are answered."""
    with serving(lm, None, max_tokens=64, max_batch=1, max_waiting=1) as (url, server):
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, url, TURN1, extra_body={"min_tokens": 64})
            deadline = time.monotonic() + 60
            while server.scheduler.in_flight < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = pool.submit(ask, url, TURN1, max_tokens=2)
            while server.scheduler.waiting < 1:
                assert time.monotonic() < deadline and not first.done(), "the queue never filled"
                time.sleep(0.01)
            refused = post(url, messages=TURN1, max_tokens=2)
            assert refused.status_code == 429, refused.text
            assert (
                refused.headers["retry-after"] == "1"
                and "--max-waiting" in refused.json()["error"]["message"]
            )
            assert first.result().usage.completion_tokens == 64
            assert second.result().usage.completion_tokens == 2
        assert _metric(httpx.get(f"{url}/metrics").text, 'requests_total{outcome="busy"}') == 1


def test_text_completions_answer_stream_and_reuse_the_prompts_kv(lm) -> None:
    """/v1/completions through the openai client: the streamed text is the unstreamed one, and a
    prompt that extends the last one (its answer appended) reuses its live KV."""
    prompt = DOC + "\nQuestion: who built the lighthouse?\nAnswer:"
    with serving(lm, None) as (url, _):
        c = client(url)
        whole = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        text = whole.choices[0].text
        assert whole.object == "text_completion" and text and whole.usage.completion_tokens <= 8
        parts = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        assert "".join(p.choices[0].text for p in parts if p.choices) == text
        longer = c.completions.create(
            model=MODEL, prompt=prompt + text + "\nWhen?", max_tokens=4, temperature=0
        )
        assert longer.usage.prompt_tokens_details.cached_tokens >= 64
        bad = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ""}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] is not None


LEDGER = " ".join(
    f"Entry {i}: the {ship} docked at pier {i % 7} with {cargo} for the {house} house."
    for i, (ship, cargo, house) in enumerate(
        zip(
            ["Gull", "Tern", "Heron", "Petrel", "Osprey", "Plover"] * 10,
            ["salt", "rye", "copper", "wool", "tar", "rope", "lamp oil", "slate"] * 8,
            ["Quill", "Marsh", "Elden", "Tide", "Fenwick"] * 12,
            strict=False,
        )
    )
)


def test_concurrent_conversations_over_one_document_share_it_in_the_pool(lm) -> None:
    """Four conversations over one document at once, through the openai client: the server computes
    the document for one of them and the others share its chunks in the pool (/metrics: the GPU
    prefix hits are the document's whole chunks three times, the pool's peak holds it once), and
    each answer is the one the conversation gets alone."""
    questions = ["Who docked at pier 3?", "What did the Tern carry?", "Which house got rye?", "How many?"]
    convs = [[{"role": "system", "content": LEDGER}, {"role": "user", "content": q}] for q in questions]
    alone = []
    for conv in convs:
        with serving(lm, None) as (url, _):
            alone.append(ask(url, conv, max_tokens=8).choices[0].message.content)
    with serving(lm, None, max_batch=4) as (url, server):
        ids = [server.prompt(ChatRequest(model=MODEL, messages=c)).ids for c in convs]
        with ThreadPoolExecutor(len(convs)) as pool:
            got = list(pool.map(lambda c: ask(url, c, max_tokens=8), convs))
        text = httpx.get(f"{url}/metrics").text
    common = min(
        next(i for i, (x, y) in enumerate(zip(ids[0], other, strict=False)) if x != y) for other in ids[1:]
    )
    doc_chunks = common // 64
    assert doc_chunks >= 12
    assert [r.choices[0].message.content for r in got] == alone
    shared = sorted(r.usage.prompt_tokens_details.cached_tokens for r in got)
    assert shared == [0] + [doc_chunks * 64] * 3
    assert _metric(text, 'tokens_total{kind="gpu"}') == 3 * doc_chunks * 64
    assert doc_chunks <= _metric(text, "pool_slots_used_peak") < 2 * doc_chunks
    assert _metric(text, "pool_slots_shared") == doc_chunks  # the idle conversations still share it
    assert _metric(text, "pool_slots_idle") == _metric(text, "pool_slots_used")  # each shared slot once
    assert _metric(text, "pool_tokens_used") == 64 * _metric(text, "pool_slots_used")


def test_pins_in_a_request_pin_their_spans_and_a_pin_past_the_floor_is_refused(lm) -> None:
    """`kvflash.pin` over HTTP: `system`, a span of a message's characters and `last-turn` pin the
    chunks that cover those tokens (the turn's stats and /metrics count them), and the conversation's
    live sequence keeps no pin after the answer. Pins that would leave the policy no room below the
    budget, or that name a message or characters the request lacks, get a 400 that says so."""
    turn2 = [
        *TURN1,
        {"role": "assistant", "content": "Mara Quill built it."},
        {"role": "user", "content": "When?"},
    ]
    cases = [(TURN1, "system", DOC), (TURN1, {"message": 0, "start": 40, "end": 200}, DOC[40:200]),
             (turn2, "last-turn", "Who built the lighthouse?")]  # fmt: skip
    with serving(lm, None) as (url, server):
        total = 0
        for messages, pin, text in cases:
            prompt = server.prompt(ChatRequest(model=MODEL, messages=messages, kvflash={"pin": [pin]}))
            ((lo, hi),) = prompt.pins
            assert text in lm.tokenizer.decode(prompt.ids[lo:hi])
            assert text not in lm.tokenizer.decode(prompt.ids[lo + 1 : hi - 1])
            chunks = chunks_of(prompt.pins, 64)
            got = ask(url, messages, max_tokens=4, extra_body={"kvflash": {"pin": [pin]}})
            assert got.model_extra["kvflash"]["pinned_chunks"] == len(chunks)
            assert all(kv.n_pinned == 0 for kv in server.scheduler.cache.idle)
            total += len(chunks)
        assert _metric(httpx.get(f"{url}/metrics").text, "pinned_chunks_total") == total
        big = [{"role": "system", "content": LEDGER * 3}, TURN1[1]]  # 61 chunks: the floor needs 68 of 64
        refused = [(big, "system", "would break the floor"), (TURN1, {"message": 5}, "no message 5"),
                   (TURN1, {"message": 1, "end": 999}, "not within message 1")]  # fmt: skip
        for messages, pin, says in refused:
            with pytest.raises(openai.BadRequestError, match=says):
                ask(url, messages, max_tokens=4, extra_body={"kvflash": {"pin": [pin]}})
        assert _metric(httpx.get(f"{url}/metrics").text, 'requests_total{outcome="refused"}') == 3


def test_a_request_past_its_time_limit_gets_504_or_has_its_answer_ended(lm) -> None:
    """--request-timeout: a request with no token by its limit fails with 504 naming the limit, and
    frees what it held; one that is answering by then ends its answer there (finish reason
    `length`, fewer tokens than it asked for). The server goes on answering."""
    long_doc = [{"role": "system", "content": LEDGER}, TURN1[1]]  # pieces of 512: checked between them
    with serving(lm, None, request_timeout=0.001) as (url, server):
        with pytest.raises(openai.APIStatusError, match="time limit") as e:
            ask(url, long_doc, max_tokens=4)
        assert e.value.status_code == 504
        settled(server)
        assert server.scheduler.engine.pool.n_used == sum(
            len(kv.resident()) for kv in server.scheduler.cache.idle
        )
        server.request_timeout = 1.5
        got = ask(url, TURN1, max_tokens=2000, extra_body={"min_tokens": 2000})
        assert got.choices[0].finish_reason == "length" and 0 < got.usage.completion_tokens < 2000
        server.request_timeout = None
        assert ask(url, TURN1, max_tokens=4).choices[0].message.content
