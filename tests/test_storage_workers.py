"""Restores and saves through worker processes (kvflash/storage/workers.py): the same blobs and the
same files as the threads give, the same refusals of damaged chunks and store errors, and reads and
saves that survive a worker's death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from kvflash.storage import ChunkCorrupt, ChunkMismatch, SnapshotStore, StoreError, workers
from kvflash.storage.workers import StoreWorkers
from tests.store_util import FP, C, D, H, L, bits, chain_fields, chunk_path, damage_at, flip, make_chain, toks


def _segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"kvflash-{os.getpid()}-")}


def _use_workers(st: SnapshotStore, w: StoreWorkers) -> None:
    """Gives the store's reads and writes other workers (a segment of another size)."""
    st.processes = st.reader.workers = st.writer.processes = w


def _chunk_files(root: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in (root / "chunks").glob("*/*.kvc")}


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A store with two worker processes (started once for the module: each imports torch) and a
    thread-only store over the same directory, each with a lossless and an fp8 snapshot."""
    root = tmp_path_factory.mktemp("workers")
    blobs = make_chain(toks(12))
    sids = {}
    for codec in ("lossless", "fp8"):
        with SnapshotStore(root / codec, codec=codec) as st:
            sids[codec] = st.put_snapshot(codec, FP, blobs)
    with_procs = {c: SnapshotStore(root / c, processes=2) for c in sids}
    for st in with_procs.values():
        st.processes.wait()
    threads = {c: SnapshotStore(root / c) for c in sids}
    yield blobs, sids, with_procs, threads
    for st in (*with_procs.values(), *threads.values()):
        st.close()


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_workers_give_what_threads_give(stores, codec) -> None:
    blobs, sids, procs, threads = stores
    hashes = procs[codec].get_snapshot(sids[codec]).chunk_hashes
    before = procs[codec].processes.decoded
    got = procs[codec].read_chunks_parallel(hashes, FP, (L, 2, H, C, D), torch.bfloat16)
    outs = [torch.full((L, 2, H, C, D), float("nan"), dtype=torch.bfloat16) for _ in hashes]
    into = procs[codec].read_chunks_parallel(hashes, FP, out=outs)
    want = threads[codec].read_chunks_parallel(hashes, FP)
    assert procs[codec].processes.decoded - before == 2 * len(hashes), "the workers served both reads"
    for g, i, o, w, b in zip(got, into, outs, want, blobs, strict=True):
        assert (g.index, g.chain_hash, g.parent_hash) == (w.index, w.chain_hash, w.parent_hash)
        assert g.tokens == w.tokens
        assert torch.equal(g.summary, w.summary) and torch.equal(bits(g.kv), bits(w.kv))
        assert i.kv is o and torch.equal(bits(o), bits(w.kv))
        if codec == "lossless":
            assert torch.equal(bits(g.kv), bits(b.kv))


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_workers_read_without_summaries_what_a_full_read_gives(stores, codec) -> None:
    _, sids, procs, threads = stores
    hashes = procs[codec].get_snapshot(sids[codec]).chunk_hashes
    before = procs[codec].processes.decoded
    fresh = procs[codec].read_chunks_parallel(hashes, FP, with_summary=False)
    outs = [torch.full((L, 2, H, C, D), float("nan"), dtype=torch.bfloat16) for _ in hashes]
    into = procs[codec].read_chunks_parallel(hashes, FP, out=outs, with_summary=False)
    assert procs[codec].processes.decoded - before == 2 * len(hashes), "the workers served both reads"
    full = threads[codec].read_chunks_parallel(hashes, FP)
    for g, i, o, f in zip(fresh, into, outs, full, strict=True):
        assert g.summary is None and i.summary is None and f.summary is not None
        assert chain_fields(g) == chain_fields(i) == chain_fields(f) and i.kv is o
        assert torch.equal(bits(g.kv), bits(f.kv)) and torch.equal(bits(o), bits(f.kv))


def test_workers_refuse_damage_without_summaries(stores, tmp_path) -> None:
    blobs, _, _, _ = stores
    st = SnapshotStore(tmp_path, processes=2)
    st.processes.wait()
    try:
        hashes = st.get_snapshot(st.put_snapshot("s", FP, blobs[:9])).chunk_hashes
        for victim, where in ((1, "token id"), (4, "kv"), (7, "summary residual")):
            flip(chunk_path(st.root, hashes[victim]), damage_at(st.read_header(hashes[victim]), where))
            run = hashes[victim - 1 : victim + 2]
            outs = [torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16) for _ in run]
            with pytest.raises(ChunkCorrupt, match=hashes[victim][:16]):
                st.read_chunks_parallel(run, FP, out=outs, with_summary=False)
            assert not outs[1].any(), f"{where}: a damaged chunk's destination is never written"
        assert st.processes.ready, "damage is the chunk's fault, not the worker's"
    finally:
        st.close()


def test_workers_refuse_damage_and_mark_it(stores, tmp_path) -> None:
    blobs, _, procs, _ = stores
    st = SnapshotStore(tmp_path, processes=2)
    st.processes.wait()
    try:
        sid = st.put_snapshot("s", FP, blobs[:6])
        hashes = st.get_snapshot(sid).chunk_hashes
        with pytest.raises(ChunkMismatch, match="shape"):
            st.read_chunks_parallel(hashes, FP, (L, 2, H, C, D + 1), torch.bfloat16)
        flip(chunk_path(st.root, hashes[4]), -10)
        outs = [torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16) for _ in hashes]
        with pytest.raises(ChunkCorrupt, match=hashes[4][:16]):
            st.read_chunks_parallel(hashes, FP, out=outs)
        assert st.processes.ready, "damage is the chunk's fault, not the worker's"
        assert not outs[4].any(), "a damaged chunk's destination is never written"
        assert [d.chunk_hash for d in st.verify(sid).damaged] == [hashes[4]]
        with pytest.raises(ChunkCorrupt, match="damaged earlier"):
            st.read_chunks_parallel(hashes, FP)
    finally:
        st.close()


def test_reads_never_wait_for_workers_and_survive_their_death(tmp_path) -> None:
    blobs = make_chain(toks(8))
    with SnapshotStore(tmp_path, processes=2) as st:
        hashes = st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes
        st.read_chunks_parallel(hashes, FP)  # workers still importing torch: the threads read
        assert st.processes.decoded == 0
        st.processes.wait()
        st.read_chunks_parallel(hashes, FP)
        assert st.processes.decoded == len(hashes)
        assert _segments() == set(), "segments are unlinked once mapped"
        victim = st.processes._all[0].proc
        victim.kill()
        victim.wait()
        got = st.read_chunks_parallel(hashes, FP)
        assert not st.processes.ready, "a dead worker retires the workers"
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))
        procs = [w.proc for w in st.processes._all]
    assert all(p.poll() is not None for p in procs), "close stops every worker"
    assert Path("/dev/shm").is_dir() and _segments() == set()


def test_a_hung_worker_is_killed_and_its_read_goes_to_the_threads(tmp_path, monkeypatch) -> None:
    """A worker that never replies (stopped here with SIGSTOP) would block its read, and `close`,
    forever: after REPLY_TIMEOUT_S it is killed, the threads read the chunks, and close returns."""
    monkeypatch.setattr(workers, "REPLY_TIMEOUT_S", 0.5)
    blobs = make_chain(toks(4))
    with SnapshotStore(tmp_path, processes=1) as st:
        hashes = st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes
        st.processes.wait()
        hung = st.processes._all[0].proc
        os.kill(hung.pid, signal.SIGSTOP)
        got = st.read_chunks_parallel(hashes, FP)
        assert hung.wait(10) == -signal.SIGKILL and not st.processes.ready
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))
        assert st.processes.decoded == 0


def test_runs_larger_than_a_segment_go_in_parts_and_oversize_chunks_to_threads(tmp_path) -> None:
    """A segment that holds one chunk (KV + summary, 3.8 KB here) makes a worker answer each run one
    chunk at a time; one that holds none sends the read to the threads, and the workers stay."""
    blobs = make_chain(toks(5))
    with SnapshotStore(tmp_path, processes=1) as st:
        hashes = st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes
        st.processes.close()
        for segment, served in ((6000, len(hashes)), (1000, 0)):
            _use_workers(st, StoreWorkers(str(st.root), 1, segment_bytes=segment))
            st.processes.wait()
            got = st.read_chunks_parallel(hashes, FP)
            assert st.processes.decoded == served and st.processes.ready
            assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))
            assert [g.tokens for g in got] == [b.tokens for b in blobs]
            st.processes.close()


def test_workers_leave_quietly_when_their_parent_dies(tmp_path) -> None:
    """A parent that exits without closing its store: each worker sees its stdin close and exits
    without a traceback, so no process outlives the parent (run waits for the workers' stderr)."""
    script = (
        "import os, sys; from kvflash.storage import SnapshotStore; "
        f"st = SnapshotStore({str(tmp_path)!r}, processes=2); st.processes.wait(); "
        "print(' '.join(str(w.proc.pid) for w in st.processes._all), flush=True); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and "Traceback" not in done.stderr, done.stderr
    for pid in pids:  # gone, or a zombie waiting for a reaper that is not its parent
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_no_segment_outlives_a_parent_that_dies_before_its_workers_start(tmp_path) -> None:
    """Segments are unlinked as soon as they are opened (the workers inherit the descriptors): a
    parent gone while its workers still import leaves nothing in shared memory."""
    script = (
        "import os, time; from kvflash.storage import SnapshotStore; "
        f"st = SnapshotStore({str(tmp_path)!r}, processes=2); time.sleep(0.3); "
        "print(os.getpid(), st.processes.n_ready, flush=True); os._exit(1)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid, ready = done.stdout.split()
    assert ready == "0"  # it died before any worker greeted
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    assert not list(shm.glob(f"kvflash-{pid}-*"))


def test_workers_ignore_an_interrupt_their_parent_survives(tmp_path) -> None:
    """Ctrl-C reaches the whole process group; the parent decides what it means, so the workers
    stay and keep serving reads."""
    blobs = make_chain(toks(6))
    with SnapshotStore(tmp_path, workers=2, processes=2) as st:
        hs = st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes
        st.processes.wait()
        for w in st.processes._all:
            os.kill(w.proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert all(w.proc.poll() is None for w in st.processes._all)
        got = st.read_chunks_parallel(hs, FP)
        assert st.processes.decoded == len(hs) and st.processes.ready
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_saves_in_workers_write_the_files_threads_write(tmp_path, codec) -> None:
    blobs = make_chain(toks(6))
    with SnapshotStore(tmp_path / "procs", codec=codec, processes=2) as st:
        st.processes.wait()
        sid = st.put_snapshot("s", FP, blobs)
        assert st.processes.encoded == len(blobs), "the workers wrote every chunk"
        rows = st.index.chunk_rows(st.get_snapshot(sid).chunk_hashes)
        got = st.read_chunks_parallel(st.get_snapshot(sid).chunk_hashes, FP)
    with SnapshotStore(tmp_path / "threads", codec=codec) as st:
        want_rows = st.index.chunk_rows(st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes)
    assert _chunk_files(tmp_path / "procs") == _chunk_files(tmp_path / "threads")
    assert {h: (r.stored_bytes, r.raw_bytes, r.codec, r.parent_hash) for h, r in rows.items()} == {
        h: (r.stored_bytes, r.raw_bytes, r.codec, r.parent_hash) for h, r in want_rows.items()
    }
    assert [g.tokens for g in got] == [b.tokens for b in blobs]
    if codec == "lossless":
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))


def test_a_store_error_in_a_worker_fails_the_save_and_leaves_nothing(tmp_path) -> None:
    """A regular file where a chunk's fan-out directory goes: the worker's write fails as the
    threads' would, the caller gets that message, no file or snapshot of the save stays, and the
    workers (whose fault it is not) stay in use."""
    blobs = make_chain(toks(6))
    with SnapshotStore(tmp_path, processes=2) as st:
        st.processes.wait()
        in_the_way = chunk_path(st.root, blobs[3].chain_hash).parent
        in_the_way.parent.mkdir(parents=True, exist_ok=True)
        in_the_way.write_bytes(b"not a directory")
        with pytest.raises(StoreError, match="not a directory"):
            st.put_snapshot("s", FP, blobs)
        assert st.list_snapshots() == [] and _chunk_files(st.root) == {}
        assert st.processes.ready
        in_the_way.unlink()
        before = st.processes.encoded
        st.put_snapshot("s", FP, blobs)
        assert len(_chunk_files(st.root)) == len(blobs) and st.processes.encoded == before + len(blobs)


def test_a_worker_that_dies_leaves_its_writes_to_the_threads(tmp_path) -> None:
    blobs = make_chain(toks(6))
    with SnapshotStore(tmp_path, processes=2) as st:
        st.processes.wait()
        victim = st.processes._all[0].proc
        victim.kill()
        victim.wait()
        sid = st.put_snapshot("s", FP, blobs)
        assert not st.processes.ready, "a dead worker retires the workers"
        got = st.read_chunks_parallel(st.get_snapshot(sid).chunk_hashes, FP)
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))
