"""Crash safety: writers and readers SIGKILLed at random points of save, prune, rm and restore, many
times, never leave a partial chunk where a reader can get it, never leave the index naming a missing
file, never harm a snapshot that verified before, and never leave a dead reader's lease holding
chunks past the next removal. A handful of kills in `make test`, 120 in `make test-reliability`."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import zlib
from pathlib import Path

import pytest
import torch

from kvflash.storage import ROOT_HASH, ChunkBlob, ChunkMissing, SnapshotNotFound, SnapshotStore
from kvflash.storage.format import decode_chunk

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
            got = st.read_chunks_parallel(st.get_snapshot(sid).chunk_hashes, FP)
            assert all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True))
        indexed = st.index.all_chunk_rows()
    on_disk = list((root / "chunks").glob("*/*.kvc"))
    for f in on_disk:  # renamed into place only when complete: even an orphan decodes
        decode_chunk(f.read_bytes(), f.stem, FP)
    return sum(f.stem not in indexed for f in on_disk), len(list((root / "chunks").glob("*/.*.tmp")))


def _pin_witness(root: Path, k: int) -> tuple[str, list[ChunkBlob]]:
    """A snapshot saved, pinned and verified between kills: no later kill may lose or harm it."""
    blobs = chain(prefix_tokens(k % 3) + list(range(5 * 10**6 + 1000 * k, 5 * 10**6 + 1000 * k + 2 * C)))
    with SnapshotStore(root, workers=2) as st:
        sid = st.put_snapshot(f"witness{k}", FP, blobs)
        st.pin(sid)
        assert st.verify(sid).ok
    return sid, blobs


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

    with SnapshotStore(root, workers=2) as st:
        snapshots = len(st.list_snapshots())
        swept = st.prune().swept_files
        assert st.verify().ok
        assert set(st.backend.list_hashes()) == set(st.index.all_chunk_rows())
        assert st.index.lease_owners() == set(), "a killed reader's lease outlived a removal"
        lost = len(set(witnesses) - {x.id for x in st.list_snapshots()})
    assert lost == 0, f"{lost} pinned snapshots lost"
    assert not list((root / "chunks").glob("*/.*.tmp"))
    assert commits >= kills // 2, "too few writers committed before their kill: the kills tested little"
    figures = dict(
        trials=kills, sigkills=2 * kills, witnesses=len(witnesses), witnesses_lost=lost,
        snapshots_left=snapshots, orphans_seen=orphans, temps_seen=temps, swept=swept,
    )  # fmt: skip
    print(f"store kill trials: {figures}")
    return figures


def test_writers_and_readers_killed_at_random_points(tmp_path) -> None:
    kill_trials(tmp_path, kills=8, seed=1234)


@pytest.mark.reliability
def test_writers_and_readers_killed_at_random_points_at_length(tmp_path) -> None:
    assert kill_trials(tmp_path, kills=120, seed=4321)["trials"] >= 100
