"""Crash safety: writers and readers SIGKILLed at random points of save, prune, rm and restore, and
`kvflash serve` processes SIGKILLed while they serve HTTP requests (restoring, prefilling, answering,
writing snapshots), many times, never leave a partial chunk where a reader can get it, never leave
the index naming a missing file, never harm a snapshot that verified before, and never leave a dead
process's lease holding chunks past the next removal. A handful of kills in `make test`, 120 store
and 24 server trials in `make test-reliability`."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random
import signal
import time
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import pytest
import torch

from kvflash.storage import ROOT_HASH, ChunkBlob, ChunkMissing, SnapshotNotFound, SnapshotStore
from kvflash.storage.format import decode_chunk, parse_header
from tests.test_server import MODEL, serve_process

FP = "fp-crash-test"
SHAPE = (2, 2, 2, 16, 32)
C = SHAPE[3]
B = 4
"""Summary blocks: the summary is the mean key of each of B equal runs of a chunk's tokens."""


def chain(tokens: list[int]) -> list[ChunkBlob]:
    blobs, parent = [], ROOT_HASH
    for i in range(len(tokens) // C):
        run = tokens[i * C : (i + 1) * C]
        g = torch.Generator().manual_seed(zlib.crc32(str(run).encode()))
        kv = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
        l, _, h, _, d = SHAPE
        summary = kv[:, 0].float().reshape(l, h, B, C // B, d).mean(3)
        blob = ChunkBlob.build(FP, i, parent, run, summary, kv)
        blobs.append(blob)
        parent = blob.chain_hash
    return blobs


def prefix_tokens(which: int) -> list[int]:
    return list(range(which * 1000, which * 1000 + 2 * C))


def _mark(path: Path) -> None:
    """Signals the test by creating a file: a writer killed while signalling through a
    multiprocessing Event can die holding the Event's lock, and the test then waits forever."""
    path.touch()


def _await(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _writer(root: str, seed: int, ready: Path, committed: Path) -> None:
    """Saves, prunes, removes and restores (under leases) until killed."""
    rng = random.Random(seed)
    st = SnapshotStore(root, workers=2)
    _mark(ready)  # kill times count from here, so a slow start on a loaded machine tests the same
    for r in range(10**9):
        tail = 10**6 + 10**4 * seed + 100 * r
        tokens = prefix_tokens(rng.randrange(3)) + list(range(tail, tail + rng.randrange(1, 6) * C))
        st.put_snapshot(f"w{seed}.{r}", FP, chain(tokens))
        if r == 0:
            _mark(committed)
        action = rng.random()
        if action < 0.25:
            st.prune(max_bytes=rng.randrange(40_000, 120_000))
        elif action < 0.4:
            if victims := [s.id for s in st.list_snapshots() if not s.pinned]:
                st.rm(rng.choice(victims))
        elif action < 0.7:
            try:
                hashes = st.get_snapshot(rng.choice(st.list_snapshots()).id).chunk_hashes
                with st.lease(hashes):
                    st.read_chunks_parallel(hashes, FP)
            except (SnapshotNotFound, ChunkMissing):
                pass


def _reader(root: str, seed: int, ready: Path) -> None:
    """Restores random snapshots under leases until killed."""
    rng = random.Random(seed)
    st = SnapshotStore(root, workers=2)
    _mark(ready)
    while True:
        try:
            snaps = st.list_snapshots()
            hashes = st.get_snapshot(rng.choice(snaps).id).chunk_hashes
            with st.lease(hashes):
                st.read_chunks_parallel(hashes, FP)
        except (SnapshotNotFound, ChunkMissing, IndexError):
            pass


def check(root: Path, witnesses: dict[str, list[ChunkBlob]]) -> tuple[int, int]:
    """Every invariant after a kill; returns (files on disk not indexed, temp files)."""
    with SnapshotStore(root, workers=2) as st:
        report = st.verify()
        assert report.ok, report
        for sid, blobs in witnesses.items():  # every snapshot that verified before: still there, bit-exact
            snap = st.get_snapshot(sid)
            got = st.read_chunks_parallel(snap.chunk_hashes, snap.fingerprint)
            assert all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True))
        indexed = st.index.all_chunk_rows()
    on_disk = list((root / "chunks").glob("*/*.kvc"))
    for f in on_disk:  # renamed into place only when complete: even an orphan decodes
        data = f.read_bytes()
        decode_chunk(data, f.stem, parse_header(data, len(data), f.stem).fingerprint)
    return sum(f.stem not in indexed for f in on_disk), len(list((root / "chunks").glob("*/.*.tmp")))


def _pin_witness(root: Path, k: int) -> tuple[str, list[ChunkBlob]]:
    """A snapshot saved, pinned and verified between kills: no later kill may lose or harm it."""
    blobs = chain(prefix_tokens(k % 3) + list(range(5 * 10**6 + 1000 * k, 5 * 10**6 + 1000 * k + 2 * C)))
    with SnapshotStore(root, workers=2) as st:
        sid = st.put_snapshot(f"witness{k}", FP, blobs)
        st.pin(sid)
        assert st.verify(sid).ok
    return sid, blobs


def final_check(root: Path, witnesses: dict[str, list[ChunkBlob]]) -> tuple[int, int, int]:
    """After the last trial: a prune sweeps what killed saves left and reaps every dead process's
    lease, then the store verifies and holds every witness. Returns (snapshots, swept, lost)."""
    with SnapshotStore(root, workers=2) as st:
        snapshots = len(st.list_snapshots())
        swept = st.prune().swept_files
        assert st.verify().ok
        assert set(st.backend.list_hashes()) == set(st.index.all_chunk_rows())
        assert st.index.lease_owners() == set(), "a killed process's lease outlived a removal"
        lost = len(set(witnesses) - {x.id for x in st.list_snapshots()})
    assert lost == 0, f"{lost} pinned snapshots lost"
    assert not list((root / "chunks").glob("*/.*.tmp"))
    return snapshots, swept, lost


def kill_trials(tmp_path: Path, kills: int, seed: int) -> dict[str, int]:
    root = tmp_path / "store"
    witnesses = dict([_pin_witness(root, -1)])
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvflash.storage"])
    rng = random.Random(seed)
    orphans = temps = commits = 0
    for k in range(kills):
        ready, committed, reading = (tmp_path / f"{n}{k}" for n in ("ready", "committed", "reading"))
        writer = ctx.Process(target=_writer, args=(str(root), k, ready, committed))
        reader = ctx.Process(target=_reader, args=(str(root), k, reading))
        writer.start()
        reader.start()
        assert _await(ready, 60) and _await(reading, 60), f"trial {k}: a process did not start"
        if k % 2:  # every other writer dies after its first commit, however loaded the machine is
            assert _await(committed, 60), f"writer {k} never committed"
        victims = [writer, reader]
        rng.shuffle(victims)
        for p in victims:  # each at its own random point
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            assert p.exitcode == -signal.SIGKILL, f"trial {k}: a process died by itself (exit {p.exitcode})"
        commits += committed.exists()
        o, t = check(root, witnesses)
        orphans, temps = orphans + o, temps + t
        if k % 4 == 0:
            witnesses.update([_pin_witness(root, k)])

    snapshots, swept, lost = final_check(root, witnesses)
    assert commits >= kills // 2, "too few writers committed before their kill: the kills tested little"
    figures = dict(
        trials=kills, sigkills=2 * kills, witnesses=len(witnesses), witnesses_lost=lost,
        snapshots_left=snapshots, orphans_seen=orphans, temps_seen=temps, swept=swept,
    )  # fmt: skip
    print(f"store kill trials: {figures}")
    return figures


SERVE_FLAGS = ("--max-tokens", "4", "--max-batch", "2", "--pool-tokens", "1024", "--sequence-tokens", "512")
"""Two requests at a time with 512 tokens each: a short ledger's stored prefix restores eagerly, a
long one's lazily (its chunks read from disk during the prefill)."""


def ledger(k: int, turn: int) -> list[dict]:
    """Conversation k over a ledger of 12 or 24 entries (some 300 or 590 tokens), at turn 1 or 2:
    a turn 2 sent to a new server restores the turn 1 the one before it saved."""
    n = 24 if k % 2 else 12
    doc = " ".join(f"Ledger {k}, entry {i}: keeper {i} tended the light in {1800 + i}." for i in range(n))
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": f"Who kept ledger {k}?"}]
    if turn == 2:
        messages += [{"role": "assistant", "content": "A keeper."}, {"role": "user", "content": "And then?"}]
    return messages


def _send(url: str, body: dict) -> bool:
    """Whether the request was answered in full; a connection the killed server dropped is not."""
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    except httpx.TransportError:
        return False
    assert r.status_code == 200, r.text
    assert "error" not in r.text
    return True


def _pin_served(root: Path, rng: random.Random) -> dict[str, list[ChunkBlob]]:
    """A snapshot a server wrote, pinned (no later save replaces it) with its KV read back, once
    verified: no later kill may lose or harm it."""
    with SnapshotStore(root, workers=2) as st:
        served = [s for s in st.list_snapshots() if s.label.startswith("serve:") and not s.pinned]
        if not served:
            return {}
        snap = st.get_snapshot(rng.choice(served).id)
        assert st.verify(snap.id).ok
        st.pin(snap.id)
        return {snap.id: st.read_chunks_parallel(snap.chunk_hashes, snap.fingerprint)}


def _await_snapshots(root: Path, n: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        with SnapshotStore(root, workers=1) as st:
            if sum(s.label.startswith("serve:") for s in st.list_snapshots()) >= n:
                return
        assert time.monotonic() < deadline, "the server never wrote its snapshots"
        time.sleep(0.1)


def _store_state(root: Path) -> str:
    """The store's snapshots (label, fingerprint's tail, chunks, pinned) and its chunks by fingerprint
    and damage: what a conversation that went cold should have found."""
    with SnapshotStore(root, workers=1) as st:
        snaps = [f"  {s.label} fp ..{s.fingerprint[-12:]} {s.n_chunks} chunks{' pinned' if s.pinned else ''}"
                 for s in st.list_snapshots()]  # fmt: skip
        rows = collections.Counter(
            (r.fingerprint[-12:], bool(r.damaged), r.refcount > 0) for r in st.index.all_chunk_rows().values()
        )
    chunks = [f"  fp ..{fp} damaged {d} referenced {ref}: {n}" for (fp, d, ref), n in sorted(rows.items())]
    return "\n".join(snaps + chunks)


def server_kill_trials(tmp_path: Path, smollm_path: Path, kills: int, seed: int) -> dict[str, int]:
    """`kvflash serve` processes on one store, each SIGKILLed at a random point of four concurrent
    requests: while it restores stored conversations, prefills, answers or writes snapshots. After
    each, the check of the store's trials; besides, every conversation that had a snapshot keeps
    one (a save writes its snapshot before it removes the one it replaces)."""
    root = tmp_path / "served"
    witnesses = dict([_pin_witness(root, -1)])
    rng = random.Random(seed)
    span = None
    answered = interrupted = orphans = temps = 0
    labels: set[str] = set()
    for k in range(kills):
        bodies = [
            {"model": MODEL, "messages": ledger(c, rng.choice((1, 2))), "stream": rng.random() < 0.5,
             "temperature": 0}
            for c in range(4)
        ]  # fmt: skip
        with serve_process(smollm_path, root, *SERVE_FLAGS) as (url, proc):
            with ThreadPoolExecutor(len(bodies)) as pool:
                t0 = time.monotonic()
                sent = [pool.submit(_send, url, b) for b in bodies]
                if span is None:  # the first server answers and saves all four: later kills fall in
                    wait(sent)  # the span of its answers
                    span = time.monotonic() - t0
                    _await_snapshots(root, len(bodies))
                else:
                    time.sleep(rng.uniform(0, 1.2 * span))
                proc.kill()
                proc.wait()
                done = sum(f.result() for f in sent)
        answered, interrupted = answered + done, interrupted + (done < len(bodies))
        assert proc.returncode == -signal.SIGKILL, f"trial {k}: the server died by itself ({proc.returncode})"
        o, t = check(root, witnesses)
        orphans, temps = orphans + o, temps + t
        with SnapshotStore(root, workers=2) as st:
            now = {s.label for s in st.list_snapshots()}
        assert labels <= now, f"trial {k}: conversations lost their snapshots: {labels - now}"
        labels = now
        if k % 4 == 0:
            witnesses.update(_pin_served(root, rng))

    with serve_process(smollm_path, root, *SERVE_FLAGS) as (url, proc):  # the store still serves
        replies = [
            httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ledger(c, 2)})
            for c in range(4)
        ]
        proc.send_signal(signal.SIGINT)
        log, _ = proc.communicate(timeout=60)  # what the server said, for the assertions below
    for c, r in enumerate(replies):
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        said = log[-4000:]
        assert cached > 0, (
            f"conversation {c} went cold: {r.json()['kvflash']}; the server said:\n{said}\n"
            f"the store holds:\n{_store_state(root)}"
        )
    _, swept, lost = final_check(root, witnesses)
    assert interrupted >= kills // 4, "too few kills came before the last answer: they tested little"
    figures = dict(
        trials=kills, sigkills=kills, requests=4 * kills, answered=answered,
        interrupted=interrupted, witnesses=len(witnesses),
        witnesses_lost=lost, conversations=len(labels), orphans_seen=orphans, temps_seen=temps, swept=swept,
    )  # fmt: skip
    print(f"server kill trials: {figures}")
    return figures


def test_writers_readers_and_servers_killed_at_random_points(tmp_path, smollm_path) -> None:
    kill_trials(tmp_path, kills=8, seed=1234)
    server_kill_trials(tmp_path, smollm_path, kills=2, seed=1234)


@pytest.mark.reliability
def test_writers_readers_and_servers_killed_at_random_points_at_length(tmp_path, smollm_path) -> None:
    store = kill_trials(tmp_path, kills=120, seed=4321)
    served = server_kill_trials(tmp_path, smollm_path, kills=24, seed=4321)
    assert store["trials"] + served["trials"] >= 100
