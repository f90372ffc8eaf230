"""Crash safety: a writer SIGKILLed at random points, many times, never leaves a partial chunk where a
reader can get it, never leaves the index naming a missing file, and never harms an older snapshot."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
import zlib
from pathlib import Path

import torch

from kvflash.storage import ROOT_HASH, ChunkBlob, ChunkMissing, SnapshotNotFound, SnapshotStore
from kvflash.storage.format import decode_chunk

FP = "fp-crash-test"
SHAPE = (2, 2, 2, 16, 32)
C = SHAPE[3]
B = 4
"""Summary blocks: the summary is the mean key of each of B equal runs of a chunk's tokens."""
KILLS = 30


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


def check(root: Path, base_id: str, base: list[ChunkBlob]) -> tuple[int, int]:
    """Every invariant after a kill; returns (files on disk not indexed, temp files)."""
    with SnapshotStore(root, workers=2) as st:
        report = st.verify()
        assert report.ok, report
        got = st.read_chunks_parallel(st.get_snapshot(base_id).chunk_hashes, FP)
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(base, got, strict=True))
        indexed = st.index.all_chunk_rows()
    on_disk = list((root / "chunks").glob("*/*.kvc"))
    for f in on_disk:  # renamed into place only when complete: even an orphan decodes
        decode_chunk(f.read_bytes(), f.stem, FP)
    return sum(f.stem not in indexed for f in on_disk), len(list((root / "chunks").glob("*/.*.tmp")))


def test_writer_killed_at_random_points(tmp_path) -> None:
    root = tmp_path / "store"
    base = chain(prefix_tokens(0) + list(range(500, 500 + 3 * C)))
    with SnapshotStore(root, workers=2) as st:
        base_id = st.put_snapshot("base", FP, base)
        st.pin(base_id)

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvflash.storage"])
    rng = random.Random(1234)
    orphans = temps = commits = 0
    for k in range(KILLS):
        ready, committed = tmp_path / f"ready{k}", tmp_path / f"committed{k}"
        p = ctx.Process(target=_writer, args=(str(root), k, ready, committed))
        p.start()
        assert _await(ready, 60), f"writer {k} did not start"
        if k % 2:  # every other writer dies after its first commit, however loaded the machine is
            assert _await(committed, 60), f"writer {k} never committed"
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert p.exitcode == -signal.SIGKILL, f"writer {k} died by itself (exit {p.exitcode})"
        commits += committed.exists()
        o, t = check(root, base_id, base)
        orphans, temps = orphans + o, temps + t

    with SnapshotStore(root, workers=2) as st:
        snapshots = len(st.list_snapshots())
        swept = st.prune().swept_files
        assert st.verify().ok
        assert set(st.backend.list_hashes()) == set(st.index.all_chunk_rows())
    assert not list((root / "chunks").glob("*/.*.tmp"))
    assert commits >= KILLS // 2, "too few writers committed before their kill: the kills tested little"
    print(
        f"{KILLS} kills: {snapshots} snapshots left; {orphans} orphan, {temps} temp files seen; {swept} swept"
    )
