"""Damage to a store, made by hand as an operator or another program could make it: every command
still runs or says in one line why not, restores still serve what is intact (or go cold), nothing
outside the store is read, written or deleted, and nothing intact is lost."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvflash.storage import ChunkCorrupt, ChunkError, SnapshotStore, StoreError
from kvflash.storage.locking import LEASE_TTL_S
from tests.store_util import FP, chunk_path, forkserver, make_chain, rewrite_header, toks


def _mount(args: list[str], what: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot {what} here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")


def _same_kv(store: SnapshotStore, sid: str, blobs) -> bool:
    got = store.read_chunks_parallel(store.get_snapshot(sid).chunk_hashes, FP)
    return all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True))


# the index


def test_an_index_that_is_not_a_database_is_set_aside_and_rebuilt(tmp_path) -> None:
    root = tmp_path / "store"
    a, b = make_chain(toks(3)), make_chain(toks(2, start=500))
    with SnapshotStore(root, workers=2) as st:
        st.put_snapshot("a", FP, a)
        st.put_snapshot("b", FP, b)
        st.put_snapshot("a-prefix", FP, a[:2])
    for suffix in ("-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)

    with pytest.warns(UserWarning, match="set aside as index.sqlite.damaged-.* rebuilt from 5 chunk files"):
        st = SnapshotStore(root, workers=2)
    with st:
        snaps = {s.label: s for s in st.list_snapshots()}
        assert sorted(s.n_chunks for s in snaps.values()) == [2, 3]  # a's prefix lives on inside a
        assert all(label.startswith("recovered:") for label in snaps)
        assert st.find_longest_prefix(FP, [x.chain_hash for x in a]) == 3
        assert all(_same_kv(st, s.id, a if s.n_chunks == 3 else b) for s in snaps.values())
        assert st.verify().ok
    assert len(list(root.glob("index.sqlite.damaged-*"))) == 1


def _saved_store(root: Path) -> list:
    """A store of three snapshots (6 chunk files), its index then checkpointed and closed."""
    chains = [make_chain(toks(2, start=1000 * k)) for k in range(3)]
    with SnapshotStore(root, workers=2) as st:
        for k, chain in enumerate(chains):
            st.put_snapshot(f"doc{k}", FP, chain)
    return chains


def _recovered(root: Path, chains: list) -> None:
    """Every chain is a snapshot again and a prune keeps every chunk file."""
    with SnapshotStore(root, workers=2) as st:
        assert sorted(s.n_chunks for s in st.list_snapshots()) == [2, 2, 2]
        assert all(st.find_longest_prefix(FP, [b.chain_hash for b in c]) == 2 for c in chains)
        assert st.prune().chunks == 0
        assert st.verify().ok
    assert len(list(root.glob("chunks/*/*.kvc"))) == 6


KILLED_MID_REBUILD = """
import os, signal, sys
from kvflash.storage import index, SnapshotStore
add = index.Index.add_snapshot
def add_then_die(self, *a, **kw):
    add(self, *a, **kw)  # the first chain recovered, then the process is killed
    os.kill(os.getpid(), signal.SIGKILL)
index.Index.add_snapshot = add_then_die
SnapshotStore(sys.argv[1])
"""


def test_a_rebuild_killed_midway_leaves_the_damaged_index_to_be_rebuilt_again(tmp_path) -> None:
    """A rebuild fills another file and only a whole one takes the index's place: a killed one
    leaves the damaged index there, never a partial index whose missing rows a prune would take
    for files to delete."""
    root = tmp_path / "store"
    chains = _saved_store(root)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_REBUILD, str(root)])
    assert killed.returncode == -signal.SIGKILL
    assert (root / "index.sqlite").read_bytes().startswith(b"this is not a database")
    with pytest.warns(UserWarning, match="is damaged.* rebuilt from 6 chunk files"):
        _recovered(root, chains)
    assert not list(root.glob("index.sqlite.rebuilding*"))


def test_an_index_missing_beside_chunk_files_is_rebuilt(tmp_path) -> None:
    root = tmp_path / "store"
    chains = _saved_store(root)
    (root / "index.sqlite").unlink()
    with pytest.warns(UserWarning, match="index .* is missing beside stored chunk files; rebuilt from 6"):
        _recovered(root, chains)


def test_an_index_damaged_past_its_first_page_is_set_aside_and_rebuilt(tmp_path) -> None:
    """Opening reads the schema version from the first page only; the quick check reads the rest."""
    root = tmp_path / "store"
    chains = _saved_store(root)
    path = root / "index.sqlite"
    data = bytearray(path.read_bytes())
    assert len(data) > 8192
    data[4096:] = os.urandom(len(data) - 4096)  # every page but the first
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="is damaged.* set aside as index.sqlite.damaged-.* rebuilt from 6"):
        _recovered(root, chains)


def test_damage_met_after_opening_is_a_store_error_and_the_next_open_rebuilds(tmp_path) -> None:
    root = tmp_path / "store"
    chains = _saved_store(root)
    st = SnapshotStore(root, workers=2)
    path = root / "index.sqlite"
    data = bytearray(path.read_bytes())
    data[4096:] = os.urandom(len(data) - 4096)
    path.write_bytes(bytes(data))
    with sqlite3.connect(path) as other:  # a write elsewhere: the store's cached pages go stale
        other.execute("PRAGMA user_version = 2")
    with pytest.raises(StoreError, match="is damaged.*the store's next open rebuilds it"):
        st.list_snapshots()
    st.close()
    with pytest.warns(UserWarning, match="rebuilt from 6 chunk files"):
        _recovered(root, chains)


def test_a_chunk_file_claiming_an_absurd_position_is_left_out_of_a_rebuild(tmp_path) -> None:
    """A header that lies consistently (its checksum matches) about its position in the chain, past
    what the index can hold, is refused as a damaged file, and the rebuild recovers the rest."""
    root = tmp_path / "store"
    chains = _saved_store(root)
    rewrite_header(chunk_path(root, chains[0][1].chain_hash), index=1 << 63)
    with SnapshotStore(root, workers=2) as st, pytest.raises(ChunkError, match="implausible chunk index"):
        st.read_chunk(chains[0][1].chain_hash, FP)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.warns(UserWarning, match="rebuilt from 5 chunk files"), SnapshotStore(root, workers=2) as st:
        assert sorted(s.n_chunks for s in st.list_snapshots()) == [1, 2, 2]  # chain 0's first chunk
        assert st.find_longest_prefix(FP, [b.chain_hash for b in chains[0]]) == 1


def test_a_damaged_index_on_a_full_disk_is_rebuilt_in_the_reserves_room(tmp_path) -> None:
    """The rebuild's file cannot be written on a full disk; the store frees its reserve file and
    rebuilds in that room, and never opens a half-made index in the meantime."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], "mount a tmpfs")
    try:
        root = mnt / "store"
        chains = _saved_store(root)
        assert (root / "reserve").is_file()
        (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
        with open(mnt / "filler", "wb", buffering=0) as f, pytest.raises(OSError, match="No space"):
            while True:
                f.write(b"\0" * 4096)
        assert os.statvfs(mnt).f_bavail == 0
        with pytest.warns(UserWarning, match="set aside as .* rebuilt from 6 chunk files"):
            st = SnapshotStore(root, workers=2)
        with st:
            assert sorted(s.n_chunks for s in st.list_snapshots()) == [2, 2, 2]
        (mnt / "filler").unlink()
        _recovered(root, chains)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_meta_that_is_not_json_is_reported_not_fatal(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)), meta={"docs": "x"})
    store.index.db.conn.execute("UPDATE snapshots SET meta = '{not json' WHERE id = ?", (sid,))
    assert [s.meta for s in store.list_snapshots()] == [{}]
    assert store.get_snapshot(sid).n_chunks == 2
    report = store.verify()
    assert report.index_errors == [f"snapshot {sid}: meta is not a JSON object"]


def test_a_malformed_hash_row_is_reported_and_pruned_without_touching_files(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    bad = "../../../outside"
    store.index.db.conn.execute(
        "INSERT INTO chunks (hash, fingerprint, chunk_index, parent_hash, n_tokens, codec, stored_bytes, "
        "raw_bytes, refcount, created, last_used) VALUES (?, ?, 0, ?, 16, 'lossless', 10, 10, 0, 0, 0)",
        (bad, FP, "0" * 64),
    )
    report = store.verify()
    assert report.damaged == [] and report.index_errors == [f"chunk row {bad!r}: not a chunk hash"]
    assert store.prune().chunks == 1  # the row goes; it named no file
    assert store.verify().ok and _same_kv(store, sid, blobs)


def test_a_lock_that_is_a_directory_stops_only_saves_and_removals(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    store.close()
    (store.root / "lock").unlink()
    (store.root / "lock").mkdir()
    with SnapshotStore(store.root, workers=2) as st:
        assert [s.id for s in st.list_snapshots()] == [sid]
        assert st.verify().ok
        with st.lease(st.get_snapshot(sid).chunk_hashes):
            assert _same_kv(st, sid, blobs)
        for op in (lambda: st.put_snapshot("t", FP, make_chain(toks(1, start=900))), lambda: st.rm(sid)):
            with pytest.raises(StoreError, match="lock.* is not a plain file"):
                op()
        assert [s.id for s in st.list_snapshots()] == [sid]


HOLD_INDEX = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("held", flush=True)
sys.stdin.read()
"""


def hold_index(root: Path) -> Callable[[], None]:
    """Starts another process that holds the index's write lock (an open BEGIN EXCLUSIVE) and
    returns the function that ends it (the process exits, and its transaction with it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_INDEX, str(root / "index.sqlite")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline() == "held\n", "the holder did not take the lock"

    def release() -> None:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(30)
            proc.stdout.close()

    return release


def test_an_index_held_by_another_writer_delays_bookkeeping_not_answers(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    release = hold_index(store.root)
    try:
        assert [s.id for s in store.list_snapshots()] == [sid]  # WAL readers are not blocked
        assert _same_kv(store, sid, blobs)
        with pytest.raises(ChunkError, match="cannot lease"):
            with store.lease(store.get_snapshot(sid).chunk_hashes):
                pass
        with pytest.warns(UserWarning, match="not counted"):
            store.record_hit(list(store.get_snapshot(sid).chunk_hashes))
    finally:
        release()
    with store.lease(store.get_snapshot(sid).chunk_hashes):
        pass


# chunk files that are not chunk files


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_chunk_path_that_is_not_a_regular_file_is_refused_without_blocking(store, kind) -> None:
    blobs = make_chain(toks(3))
    sid = store.put_snapshot("s", FP, blobs)
    victim = chunk_path(store.root, blobs[1].chain_hash)
    victim.unlink()
    victim.mkdir() if kind == "directory" else os.mkfifo(victim)

    results: list[object] = []

    def attempt() -> None:
        try:
            store.read_chunk(blobs[1].chain_hash, FP)
        except ChunkError as e:
            results.append(e)
        results.append(store.verify(sid))
        try:
            store.backend.get_range(blobs[1].chain_hash, 0, 100)
        except ChunkError as e:
            results.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"a reader blocked on a {kind} in the store"
    err, report, summary_err = results
    assert isinstance(err, ChunkCorrupt) and "not a regular file" in err.reason
    assert isinstance(summary_err, ChunkCorrupt)
    assert [d.chunk_hash for d in report.damaged] == [blobs[1].chain_hash]
    store.put_snapshot("again", FP, blobs) if kind == "fifo" else None
    store.rm(sid)
    store.prune()  # unlinks what is in the store, a FIFO or an empty directory alike
    assert store.verify().ok


# symlinks


def test_reads_do_not_follow_a_symlinked_chunk_file(store, tmp_path) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    victim = chunk_path(store.root, blobs[1].chain_hash)
    outside = tmp_path / "outside.kvc"
    victim.replace(outside)  # a valid chunk, now outside the store
    victim.symlink_to(outside)
    with pytest.raises(ChunkCorrupt, match="symlink"):
        store.read_chunk(blobs[1].chain_hash, FP)
    assert [d.chunk_hash for d in store.verify(sid).damaged] == [blobs[1].chain_hash]
    store.put_snapshot("again", FP, blobs)  # the rewrite replaces the link, not its target
    assert not victim.is_symlink() and outside.exists() and store.verify().ok


def test_a_symlinked_fanout_directory_is_never_read_written_or_swept(store, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    h = blobs[0].chain_hash
    fan = store.root / "chunks" / h[:2]
    for f in fan.iterdir():
        f.replace(outside / f.name)
    fan.rmdir()
    fan.symlink_to(outside)
    bait = outside / f".{'a' * 64}.0000.tmp"
    bait.write_bytes(b"not the store's")
    before = sorted(p.name for p in outside.iterdir())

    with pytest.raises(ChunkCorrupt, match="symlink"):
        store.read_chunk(h, FP)
    with pytest.raises(StoreError, match="symlink"):
        store.put_snapshot("t", FP, blobs)
    store.rm(sid)
    store.prune()
    assert sorted(p.name for p in outside.iterdir()) == before and bait.exists()


# sizes before reads


def test_verify_reads_a_padded_file_header_first(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    victim = chunk_path(store.root, blobs[1].chain_hash)
    os.truncate(victim, 256 << 20)  # sparse: costs no disk, but a whole read costs its size
    tracemalloc.start()
    report = store.verify(sid)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [d.chunk_hash for d in report.damaged] == [blobs[1].chain_hash]
    assert "the file has" in report.damaged[0].reason
    assert peak < 4 << 20, f"verify of a padded file allocated {peak} bytes"


# refcounts


def test_refcounts_of_zero_neither_list_nor_delete_live_chunks(store) -> None:
    keep, gone = make_chain(toks(3)), make_chain(toks(2, start=700))
    sid = store.put_snapshot("keep", FP, keep)
    old = store.put_snapshot("gone", FP, gone)
    store.pin(sid)
    store.index.db.conn.execute("UPDATE chunks SET refcount = 0")
    plan = store.prune(max_bytes=0, dry_run=True)
    assert plan.snapshots == [old] and plan.chunks == 2  # gone's own chunks only
    report = store.prune(max_bytes=0)
    assert report.snapshots == [old] and report.chunks == 2
    assert store.verify().ok and _same_kv(store, sid, keep)
    store.unpin(sid)
    store.index.db.conn.execute("UPDATE chunks SET refcount = 0")
    assert store.rm(sid).chunks == 3 and store.du().chunks == 0


# files behind the index's back


def test_orphan_files_are_visible_to_du_and_verify(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    for blob in make_chain(toks(3, start=900)):  # a save killed between its files and its index row
        store.writer._store_one(blob)
    tmp = chunk_path(store.root, "ab" * 32).parent / f".{'ab' * 32}.0123abcd.tmp"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(b"x" * 1000)
    usage, report = store.du(), store.verify()
    assert usage.orphan_files == 4 and usage.orphan_bytes > 1000
    assert report.ok and (report.orphan_files, report.orphan_bytes) == (
        usage.orphan_files,
        usage.orphan_bytes,
    )
    assert store.prune().swept_files == 4
    assert store.du().orphan_files == 0 and [s.id for s in store.list_snapshots()] == [sid]


def test_a_save_after_chunks_were_deleted_rewrites_them(store) -> None:
    import shutil

    blobs = make_chain(toks(3))
    store.put_snapshot("s", FP, blobs)
    shutil.rmtree(store.root / "chunks")
    assert store.find_longest_prefix(FP, [b.chain_hash for b in blobs]) == 0
    sid = store.put_snapshot("s2", FP, blobs)
    assert _same_kv(store, sid, blobs)
    report = store.verify()
    assert report.damaged == [] or {d.snapshots for d in report.damaged} != {(sid,)}
    assert store.verify(sid).ok


# a read-only store, a full disk


def test_a_read_only_store_lists_verifies_and_restores(tmp_path) -> None:
    root = tmp_path / "store"
    blobs = make_chain(toks(2))
    with SnapshotStore(root, workers=2) as st:
        sid = st.put_snapshot("s", FP, blobs)
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount(["--bind", str(root), str(ro)], "bind-mount")
    try:
        _mount(["-o", "remount,bind,ro", str(ro)], "remount read-only")
        with SnapshotStore(ro, workers=2) as st:
            assert st.read_only and [s.id for s in st.list_snapshots()] == [sid]
            assert st.verify().ok and st.du().snapshots == 1
            with st.lease(st.get_snapshot(sid).chunk_hashes):
                assert _same_kv(st, sid, blobs)
            st.record_hit(list(st.get_snapshot(sid).chunk_hashes))
            with pytest.raises(StoreError, match="read-only: nothing saved"):
                st.put_snapshot("t", FP, make_chain(toks(1, start=900)))
            with pytest.raises(StoreError, match="read-only: nothing removed"):
                st.rm(sid)
            assert st.prune(dry_run=True).snapshots == []
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], "mount a 4 MiB tmpfs")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while os.write(fd, b"\1" * size):
                    pass
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def test_on_a_full_disk_commands_run_and_removals_free_space(tiny_fs) -> None:
    from tests.store_util import noise_chain

    root = tiny_fs / "store"
    first, second = noise_chain(2, start=0), noise_chain(2, start=5000)
    with SnapshotStore(root, workers=2) as st:
        keep = st.put_snapshot("keep", FP, first)
        drop = st.put_snapshot("drop", FP, second)
    _fill(tiny_fs)
    assert os.statvfs(tiny_fs).f_bavail == 0
    with SnapshotStore(root, workers=2) as st:
        assert {s.id for s in st.list_snapshots()} == {keep, drop}
        assert st.verify().ok and st.du().snapshots == 2
        assert _same_kv(st, keep, first)
        st.rm(drop)
        assert os.statvfs(tiny_fs).f_bavail > 0
        assert [s.id for s in st.list_snapshots()] == [keep] and st.verify().ok


# leases


def _hold_lease(root: str, hashes: list[str], ready: str) -> None:
    st = SnapshotStore(root)
    with st.lease(hashes):
        Path(ready).touch()
        time.sleep(120)


def test_a_lease_lives_as_long_as_its_owner_whatever_its_pid_or_heartbeat(store, tmp_path) -> None:
    """Pids mean nothing across pid namespaces and a heartbeat can stall: while the owner process
    lives, its leased chunks stay; once it is gone they go at the next removal."""
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    hs = list(store.get_snapshot(sid).chunk_hashes)
    ready = tmp_path / "ready"
    p = forkserver().Process(target=_hold_lease, args=(str(store.root), hs, str(ready)))
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline and p.is_alive(), "the lease holder did not start"
            time.sleep(0.05)
        dead_pid = _a_dead_pid()
        # as another pid namespace would show it, with a heartbeat stalled past its TTL
        store.index.db.conn.execute(
            "UPDATE leases SET pid = ?, heartbeat = ?", (dead_pid, time.time() - 10 * LEASE_TTL_S)
        )
        os.kill(p.pid, signal.SIGSTOP)  # a stalled process: its heartbeat thread stops too
        store.rm(sid)
        assert store.prune().chunks == 0 and store.du().chunks == 2
        assert len(store.read_chunks_parallel(hs, FP)) == 2
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert store.prune().chunks == 2


def _a_dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_lease_without_an_owner_file_expires_with_its_heartbeat(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    hs = list(store.get_snapshot(sid).chunk_hashes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.index.add_lease("0" * 16, "", hs, time.time())  # as an older writer left it
    store.rm(sid)
    assert store.prune().chunks == 0
    store.index.db.conn.execute("UPDATE leases SET heartbeat = ?", (time.time() - LEASE_TTL_S - 1,))
    assert store.prune().chunks == 2
