"""Several users of one store at once, each a real process where kvflash runs as one: a server
answering HTTP requests while `kvflash ask` processes answer and `kvflash snapshot prune` processes
remove snapshots; and a prune while a real engine's lazily restored sequence still reads from the
store. Every answer is given, every command succeeds, the store verifies afterwards, and a prune
never removes a chunk a live lease covers. Marked `reliability`: `make test-reliability` runs them."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import SnapshotStore
from tests.test_ask_damaged_store import DOC, QUESTION
from tests.test_server import MODEL, serve_process
from tests.test_session import Q1, Q2, document, engine, turns
from tests.test_storage_crash import SERVE_FLAGS, ledger


@pytest.fixture(scope="module")
def lm(smollm_path):
    from kvflash.models.loader import load_model

    return load_model(smollm_path, device="cpu")


def kvflash(*argv: str) -> subprocess.CompletedProcess:
    """The real `kvflash` command in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "kvflash.cli.app", *argv], capture_output=True, text=True, timeout=300
    )


def ask(smollm_path: Path, doc: Path, store: Path | None) -> str:
    where = ["--store", str(store)] if store else ["--no-store"]
    r = kvflash("ask", str(doc), QUESTION, "-n", "4", "--json", "--pool-tokens", "1024", *where,
                "--model", str(smollm_path), "--device", "cpu")  # fmt: skip
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)["answer"]


@pytest.mark.reliability
def test_a_server_ask_and_prune_processes_share_one_store(smollm_path, tmp_path) -> None:
    """Four conversations over HTTP, four `kvflash ask` processes over one document and a prune
    every half second to a random size, all at once: every request and every ask is answered (the
    asks as a cold prefill answers), every prune succeeds, and afterwards the store verifies and
    holds no lease."""
    store = tmp_path / "store"
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    cold = ask(smollm_path, doc, None)
    rng = random.Random(0)
    stop, prunes = threading.Event(), []

    def prune_until_stopped() -> None:
        while not stop.wait(0.5):
            r = kvflash(
                "snapshot", "prune", "--max-bytes", str(rng.randrange(0, 40 << 20)), "--store", str(store)
            )
            prunes.append(r)

    def converse(c: int) -> list[int]:
        statuses = []
        for turn in (1, 2):
            body = {"model": MODEL, "messages": ledger(c, turn), "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
            statuses.append(r.status_code)
            assert r.json()["choices"][0]["message"]["content"], r.text
        return statuses

    with serve_process(smollm_path, store, *SERVE_FLAGS) as (url, proc):
        pruner = threading.Thread(target=prune_until_stopped)
        pruner.start()
        try:
            with ThreadPoolExecutor(6) as pool:
                talks = [pool.submit(converse, c) for c in range(4)]
                asks = [pool.submit(ask, smollm_path, doc, store) for _ in range(4)]
                statuses = [s for t in talks for s in t.result()]
                answers = [a.result() for a in asks]
        finally:
            stop.set()
            pruner.join()
        proc.send_signal(signal.SIGINT)  #: the server stops, writing what it staged
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    assert statuses == [200] * 8
    assert answers == [cold] * 4
    assert prunes and all(r.returncode == 0 and not r.stderr.strip() for r in prunes), prunes
    verify = kvflash("snapshot", "verify", "--all", "--json", "--store", str(store))
    assert verify.returncode == 0 and json.loads(verify.stdout)["ok"], verify.stdout + verify.stderr
    with SnapshotStore(store, workers=2) as st:
        st.prune()
        assert st.index.lease_owners() == set()
        assert st.verify().ok


def on_disk_only(kv) -> set[str]:
    return {ch.disk for ch in kv.seq.chunks if ch.disk and ch.gpu is None and ch.host is None}


@pytest.mark.reliability
def test_a_prune_never_removes_what_a_lazy_restore_still_reads(lm, tmp_path) -> None:
    """A lazily restored sequence reads chunks when residency selects them, for as long as it lives.
    In other processes, `kvflash snapshot prune --max-bytes 0` keeps the snapshot (its chunks are
    leased) and `kvflash snapshot rm` removes it: the chunks the lease covers stay on disk, the
    sequence reads every one of them afterwards (its turns and its prefetch) with no fallback, and
    once it is freed a prune removes them."""
    from kvflash.serve.session import Session

    doc = document(n_sentences=60)
    root = tmp_path / "store"
    with SnapshotStore(root) as store:
        turns(Session(engine(lm, pool_tokens=512), [doc], store), [Q1])
    with SnapshotStore(root) as store:
        sess = Session(engine(lm, pool_tokens=512), [doc], store, lazy=True)
        sess.snapshots.prefetch = False  # what is read, the turns read
        try:
            _, first = sess.ask(Q1, 4)
            assert first.source == "lazy"
            unread = on_disk_only(sess.kv)
            assert unread
            pruned = kvflash("snapshot", "prune", "--max-bytes", "0", "--json", "--store", str(root))
            assert pruned.returncode == 0, pruned.stderr
            assert json.loads(pruned.stdout)["snapshots"] == []  # it holds leased chunks: it stays
            for snap in store.list_snapshots():
                removed = kvflash("snapshot", "rm", snap.id, "--store", str(root))
                assert removed.returncode == 0, removed.stderr
            assert not store.list_snapshots()  # the snapshot is gone ...
            assert all(store.backend.exists(h) for h in unread)  # ... the chunks its lease covers are not
            read_before = sess.kv.moved["disk"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                text, stats = sess.ask(Q2, 4)
                assert text and stats.source == "memory"
                KVSnapshots._prefetch(sess.kv)  # what the sequence reads after an answer: the rest
                text, _ = sess.ask("Who tends the lighthouse now?", 4)
                assert text
            assert not caught, [str(w.message) for w in caught]  # no read failed, nothing fell back
            assert not on_disk_only(sess.kv), "a leased chunk could not be read"
            assert sess.kv.moved["disk"] - read_before >= len(unread) * sess.kv.chunk_nbytes
        finally:
            sess.close()
        assert store.prune(max_bytes=0).chunks >= len(unread)  # the lease went with the sequence
        assert not list(store.backend.list_hashes())
