"""The shared snapshot tier on a real redis-server (started per test on a free 127.0.0.1 port): one
format with the disk store, hits across servers, concurrent writers, prunes beside restores, a
Redis killed mid-save, an evicting Redis, a Redis that is down or slow, and the `snapshot` CLI."""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import threading
import time
import warnings

import pytest
import torch

from kvflash.storage import ChunkMissing, SnapshotStore, StoreError, redis_index
from kvflash.storage.errors import ChunkCorrupt, ChunkUnavailable
from kvflash.storage.format import MAX_FILE_BYTES
from kvflash.storage.redis_link import RedisConfig, SharedUnavailable
from kvflash.storage.redis_store import RedisStore
from kvflash.storage.tiered import TierConfig, TieredStore
from tests.redis_util import RedisServer
from tests.store_util import FP, bits, chunk_path, make_chain, toks
from tests.test_cli_inputs import kvflash, one_error_line


def hashes_of(chain) -> list[str]:
    return [b.chain_hash for b in chain]


def same_kv(got, chain) -> bool:
    return len(got) == len(chain) and all(
        torch.equal(bits(a.kv), bits(b.kv)) and a.tokens == b.tokens for a, b in zip(got, chain, strict=True)
    )


def read_through(store: TieredStore, chain, n: int, timeout_s: float = 10) -> None:
    """Waits until the local tier holds chain's first n chunks, which read-through copies there in
    the background."""
    deadline = time.monotonic() + timeout_s
    while store.local.find_longest_prefix(FP, hashes_of(chain)) < n:
        assert time.monotonic() < deadline, "read-through never reached the local tier"
        time.sleep(0.05)


def copied_to(server: RedisServer, *ids: str, timeout_s: float = 10) -> None:
    """Waits until Redis holds the snapshots `ids`, which a tiered store copies there in the
    background."""
    deadline = time.monotonic() + timeout_s
    while not all(server.client().exists(f"kvflash:snap:{sid}") for sid in ids):
        assert time.monotonic() < deadline, f"snapshots {ids} never reached Redis"
        time.sleep(0.05)


def blob_keys(server: RedisServer) -> list[bytes]:
    return list(server.client().scan_iter(match="kvflash:blob:*"))


def test_a_chunk_saved_by_one_server_is_a_hit_on_another_in_the_disk_files_bytes(redis_server, tmp_path):
    chain = make_chain(toks(6))
    with RedisStore(redis_server.url) as a, RedisStore(redis_server.url) as b:
        sid = a.put_snapshot("doc", FP, chain, {"k": 1})
        assert b.find_longest_prefix(FP, hashes_of(chain)) == 6
        assert [s.id for s in b.list_snapshots()] == [sid]
        with b.lease(hashes_of(chain)):
            assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        b.record_hit(hashes_of(chain))
        assert a.get_snapshot(sid).hits == 1
        assert b.verify().ok
    with SnapshotStore(tmp_path / "disk") as disk:
        disk.put_snapshot("doc", FP, chain)
        for blob in chain:
            on_disk = disk.backend.path(blob.chain_hash).read_bytes()
            assert redis_server.client().get(f"kvflash:blob:{blob.chain_hash}") == on_disk


def _save_many(url: str, go, label: str, rounds: int) -> None:
    chain = make_chain(toks(8))
    with RedisStore(url) as st:
        go.wait()
        for i in range(rounds):
            st.put_snapshot(f"{label}-{i}", FP, chain)


def test_two_processes_saving_one_document_at_once_store_each_chunk_once_and_count_it_right(redis_server):
    ctx = mp.get_context("fork")
    go = ctx.Event()
    procs = [ctx.Process(target=_save_many, args=(redis_server.url, go, w, 6)) for w in ("a", "b")]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    chain = make_chain(toks(8))
    with RedisStore(redis_server.url) as st:
        snaps = st.list_snapshots()
        assert len(snaps) == 12
        assert len(blob_keys(redis_server)) == 8  # content addressing: one copy per chunk
        rows = st.index.chunk_rows(hashes_of(chain))
        assert {r.refcount for r in rows.values()} == {12}
        report = st.verify()
        assert report.ok and not report.orphan_files, report
        assert same_kv(st.read_chunks_parallel(hashes_of(chain), FP), chain)


def test_a_prune_on_one_server_spares_what_another_is_restoring(redis_server):
    chain = make_chain(toks(5))
    with RedisStore(redis_server.url) as a, RedisStore(redis_server.url) as b:
        sid = a.put_snapshot("doc", FP, chain)
        with b.lease(hashes_of(chain)):
            report = a.prune(max_bytes=0)
            assert report.snapshots == [] and report.chunks == 0
            assert a.rm(sid).snapshots == []
            assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        report = a.prune(max_bytes=0)
        assert report.snapshots == [sid] and report.chunks == 5
        assert blob_keys(redis_server) == []


def test_a_prune_reports_the_bytes_of_the_rows_it_decided_on(redis_server, monkeypatch):
    """Another server's save that commits between a prune's start and its decision is counted in
    the report from the decision's own reading of the index."""
    with RedisStore(redis_server.url) as a, RedisStore(redis_server.url) as b:
        a.put_snapshot("old", FP, make_chain(toks(2)))
        remove = a.index.remove

        def save_elsewhere_first(*args, **kw):
            b.put_snapshot("new", FP, make_chain(toks(2, start=5000)))
            return remove(*args, **kw)

        monkeypatch.setattr(a.index, "remove", save_elsewhere_first)
        report = a.prune(max_bytes=0)
        assert report.chunks == 4 and len(report.snapshots) == 2
        assert report.freed_bytes > 0 and report.remaining_bytes == 0
        assert a.list_snapshots() == [] and a.index.all_chunk_rows() == {}


def test_a_local_chunk_marked_damaged_is_whole_again_once_copied_down(redis_server, tmp_path):
    """A local chunk file found damaged is marked; the tiered store brings the intact copy down from
    Redis for a save that names it, and the mark goes with the bad file."""
    chain = make_chain(toks(4))
    hashes = hashes_of(chain)
    with TieredStore(SnapshotStore(tmp_path / "local"), RedisStore(redis_server.url)) as st:
        sid = st.put_snapshot("conv", FP, chain[:3])
        deadline = time.monotonic() + 10
        while sid not in [s.id for s in st.shared.list_snapshots()]:
            assert time.monotonic() < deadline, "the snapshot never reached Redis"
            time.sleep(0.05)
        path = chunk_path(tmp_path / "local", hashes[1])
        data = bytearray(path.read_bytes())
        data[-20] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(ChunkCorrupt):
            st.local.read_chunk(hashes[1], FP)
        assert st.local.index.chunk_rows([hashes[1]])[hashes[1]].damaged
        assert st.find_longest_prefix(FP, hashes[:3]) == 3
        st.put_snapshot("conv", FP, [*hashes[:3], chain[3]])
        assert st.local.index.chunk_rows([hashes[1]])[hashes[1]].damaged is None
        assert st.local.verify().ok


def test_a_lease_of_a_server_that_died_expires_with_its_heartbeat(redis_server, monkeypatch):
    monkeypatch.setattr(redis_index, "LEASE_TTL_S", 0.3)
    chain = make_chain(toks(3))
    with RedisStore(redis_server.url) as a, RedisStore(redis_server.url) as b:
        a.put_snapshot("doc", FP, chain)
        b.index.add_lease("deadbeefdeadbeef", "gone", hashes_of(chain), time.time())  # never beats
        assert a.prune(max_bytes=0).chunks == 0
        time.sleep(0.4)
        assert a.prune(max_bytes=0).chunks == 3


def test_a_save_whose_chunk_was_pruned_meanwhile_commits_nothing(redis_server):
    """The index script checks every blob it names: a chunk given by hash that a prune took between
    the save's lookup and its commit fails the save whole, never a snapshot with a hole."""
    chain = make_chain(toks(4))
    with RedisStore(redis_server.url) as st:
        st.put_snapshot("doc", FP, chain)
        known = hashes_of(chain)
        assert st.find_longest_prefix(FP, known) == 4
        redis_server.client().delete(f"kvflash:blob:{known[2]}")
        with pytest.raises(ChunkMissing):
            st.index.add_snapshot("next", FP, 64, "{}", known, [], time.time())
        assert [s.label for s in st.list_snapshots()] == ["doc"]


def _save_until_killed(url: str, seed: int) -> None:
    rng = random.Random(seed)
    with RedisStore(RedisConfig(url, retry_s=0.05)) as st:
        for _ in range(200):
            doc = rng.randrange(1 << 20)
            try:
                st.put_snapshot(f"doc-{doc}", FP, make_chain(toks(6, start=doc)))
            except StoreError:
                return


def test_redis_killed_mid_save_and_restarted_shows_no_half_written_snapshot(tmp_path):
    server = RedisServer(tmp_path / "r", "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        ctx = mp.get_context("fork")
        for trial in range(3):
            saver = ctx.Process(target=_save_until_killed, args=(server.url, trial))
            saver.start()
            time.sleep(0.3 + 0.3 * random.random())
            server.kill()
            saver.join(30)
            assert saver.exitcode == 0
            server.start()
            with RedisStore(server.url) as st:
                snaps = st.list_snapshots()
                assert snaps, "no save committed before the kill"
                for s in snaps:
                    chain = make_chain(toks(6, start=int(s.label.split("-")[1])))
                    assert s.n_chunks == 6 and st.find_longest_prefix(FP, hashes_of(chain)) == 6
                    assert same_kv(st.read_chunks_parallel(hashes_of(chain), FP), chain)
                report = st.verify()
                assert report.ok, report
    finally:
        server.stop()


def test_an_evicting_redis_loses_whole_chunks_and_lookups_take_them_as_misses(tmp_path):
    server = RedisServer(tmp_path / "r", "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru").start()
    try:
        docs = [make_chain(toks(4, start=1000 * i), dtype=torch.float32) for i in range(60)]
        with RedisStore(server.url) as st, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, chain in enumerate(docs):
                try:
                    st.put_snapshot(f"doc-{i}", FP, chain)
                except ChunkMissing:
                    pass  # a blob evicted before its commit: nothing was indexed
            assert int(server.client().info("stats")["evicted_keys"]) > 0
            found = [st.find_longest_prefix(FP, hashes_of(chain)) for chain in docs]
            assert min(found) < 4, "nothing was evicted from the index's view"
            for n, chain in zip(found, docs, strict=True):
                try:  # Redis evicts on reads too (a reply's buffer counts): a chunk may go meanwhile
                    assert same_kv(st.read_chunks_parallel(hashes_of(chain[:n]), FP), chain[:n])
                except ChunkMissing:  # ... and then the next lookup stops before it
                    assert st.find_longest_prefix(FP, hashes_of(chain)) < n
            for s in st.list_snapshots():  # listed snapshots are whole, or their lookup stops early
                assert s.n_chunks == 4
    finally:
        server.stop()


def test_an_unreachable_redis_fails_fast_and_is_tried_again_later(redis_server):
    cfg = RedisConfig(redis_server.url, retry_s=0.5)
    with RedisStore(cfg) as st:
        chain = make_chain(toks(2))
        st.put_snapshot("doc", FP, chain)
        redis_server.kill()
        with pytest.warns(UserWarning, match="unreachable"):
            with pytest.raises(SharedUnavailable):
                st.list_snapshots()
        t0 = time.monotonic()
        for _ in range(100):  # within the retry time: no connection is tried
            with pytest.raises(StoreError):
                st.find_longest_prefix(FP, hashes_of(chain))
        assert time.monotonic() - t0 < 0.5
        redis_server.start()  # no persistence configured: it comes back empty
        time.sleep(0.5)
        with pytest.warns(UserWarning, match="reachable again"):
            assert st.list_snapshots() == []


def test_a_redis_that_accepts_but_never_answers_times_out(tmp_path):
    """A hung Redis: the call ends at its timeout (redis-py would otherwise retry with backoff)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        t0 = time.monotonic()
        with pytest.raises(SharedUnavailable, match="unreachable"):
            RedisStore(RedisConfig(url, timeout_s=0.3))
        assert time.monotonic() - t0 < 1.5


def test_the_tiered_store_reads_through_and_writes_back(redis_server, tmp_path):
    chain = make_chain(toks(5))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        sid = a.put_snapshot("doc", FP, chain)
    with RedisStore(redis_server.url) as shared:  # closing drained the copy
        assert [s.id for s in shared.list_snapshots()] == [sid]
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url)) as b:
        assert b.local.find_longest_prefix(FP, hashes_of(chain)) == 0
        assert b.find_longest_prefix(FP, hashes_of(chain)) == 5
        with b.lease(hashes_of(chain)):
            assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        read_through(b, chain, 5)
        grown = b.put_snapshot("doc", FP, [*hashes_of(chain), *make_chain(toks(6))[5:]])
        b.rm(sid)
    with RedisStore(redis_server.url) as shared:
        assert [s.id for s in shared.list_snapshots()] == [grown]
        assert shared.verify().ok


def test_the_tiered_store_serves_locally_while_redis_is_down_and_catches_up(redis_server, tmp_path):
    chain = make_chain(toks(4))
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    with TieredStore(SnapshotStore(tmp_path / "a"), shared) as st, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        redis_server.kill()
        sid = st.put_snapshot("doc", FP, chain)
        assert st.find_longest_prefix(FP, hashes_of(chain)) == 4
        assert same_kv(st.read_chunks_parallel(hashes_of(chain), FP), chain)
        assert [s.id for s in st.list_snapshots()] == [sid]
        redis_server.start()
        copied_to(redis_server, sid)
    with RedisStore(redis_server.url) as again:
        assert same_kv(again.read_chunks_parallel(hashes_of(chain), FP), chain)


def test_the_snapshot_cli_works_on_the_shared_tier(redis_server, capfd, monkeypatch):
    chain = make_chain(toks(3))
    with RedisStore(redis_server.url) as st:
        sid = st.put_snapshot("doc", FP, chain)
    url = redis_server.url
    for argv in (["list"], ["verify", "--all"], ["pin", sid], ["du"]):
        code, out, err = kvflash(["snapshot", *argv, "--shared-store", url], capfd, monkeypatch)
        assert code in (0, None) and not err, err
    assert "doc" in kvflash(["snapshot", "list", "--shared-store", url], capfd, monkeypatch)[1]
    code, out, _ = kvflash(
        ["snapshot", "prune", "--max-bytes", "0", "--shared-store", url], capfd, monkeypatch
    )
    assert "removed 0 snapshots" in out  # pinned
    kvflash(["snapshot", "unpin", sid, "--shared-store", url], capfd, monkeypatch)
    code, out, _ = kvflash(["snapshot", "rm", sid, "--shared-store", url], capfd, monkeypatch)
    assert f"removed 1 snapshots ({sid}) and 3 chunks" in out


def test_a_wrong_password_or_an_unreachable_url_is_one_line(tmp_path, capfd, monkeypatch):
    server = RedisServer(tmp_path / "r", password="s3cret").start()
    try:
        wrong = server.url.replace("s3cret", "nope")
        cases = {
            wrong: "password",
            server.url.replace(":s3cret@", ""): "password",
            f"redis://127.0.0.1:{server.port + 1}/0": "unreachable",
            "http://127.0.0.1:80/": "not a Redis URL",
            "redis://127.0.0.1:notaport/0": "not a Redis URL",
        }
        for url, why in cases.items():
            line = one_error_line(
                *kvflash(["snapshot", "list", "--shared-store", url], capfd, monkeypatch)[::2]
            )
            assert why in line and "nope" not in line, line
        line = one_error_line(
            *kvflash(
                ["snapshot", "list", "--store", str(tmp_path), "--shared-store", server.url],
                capfd,
                monkeypatch,
            )[::2]
        )
        assert "not both" in line
    finally:
        server.stop()


def test_a_blob_damaged_in_redis_is_refused_and_marked(redis_server):
    chain = make_chain(toks(2))
    with RedisStore(redis_server.url) as st:
        st.put_snapshot("doc", FP, chain)
        key = f"kvflash:blob:{chain[1].chain_hash}"
        data = bytearray(redis_server.client().get(key))
        data[-5] ^= 0xFF
        redis_server.client().set(key, bytes(data))
        with pytest.raises(StoreError):
            st.read_chunks_parallel(hashes_of(chain), FP)
        assert st.find_longest_prefix(FP, hashes_of(chain)) == 1
        assert [d.chunk_hash for d in st.verify().damaged] == [chain[1].chain_hash]


def test_copies_waiting_for_a_down_redis_stay_within_their_byte_budget(redis_server, tmp_path):
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    cfg = TierConfig(writeback_bytes=1)
    # closed with Redis still down, the one copy that waited is reported as not made
    with pytest.warns(UserWarning, match="1 snapshots were not copied"):
        with TieredStore(SnapshotStore(tmp_path / "a"), shared, cfg) as st:
            redis_server.kill()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                first = st.put_snapshot("one", FP, make_chain(toks(2)))
                second = st.put_snapshot("two", FP, make_chain(toks(2, start=500)))
            assert any(f"snapshot {second} stays local" in str(w.message) for w in seen)
            assert {s.id for s in st.local.list_snapshots()} == {first, second}


def test_a_snapshot_whose_replacing_copy_was_dropped_stays_shared(tmp_path):
    """A conversation's newer snapshot replaces its older one; while Redis is down the newer one's
    copy is dropped for the write-back budget, and the older one is then not removed from Redis
    either: the shared tier keeps the conversation's last snapshot it has."""
    redis_server = RedisServer(tmp_path / "r", "--appendonly", "yes", "--appendfsync", "always").start()
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    with TieredStore(SnapshotStore(tmp_path / "a"), shared, TierConfig(writeback_bytes=1)) as st:
        old = st.put_snapshot("doc", FP, make_chain(toks(2)))
        copied_to(redis_server, old)
        redis_server.kill()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            other = st.put_snapshot("other", FP, make_chain(toks(2, start=700)))  # first in line for Redis
            new = st.put_snapshot("doc", FP, make_chain(toks(3)), succeeds=[old])
            st.rm(old)
        assert any(f"snapshot {new} stays local" in str(w.message) for w in seen)
        redis_server.start()
        deadline = time.monotonic() + 10
        with pytest.warns(UserWarning, match="reachable again"):
            while not redis_server.client().exists(f"kvflash:snap:{other}") or st._jobs:
                assert time.monotonic() < deadline, "the copies waiting for Redis never went"
                time.sleep(0.05)
    try:
        with RedisStore(redis_server.url) as again:
            ids = {s.id for s in again.list_snapshots()}
        assert old in ids and new not in ids
    finally:
        redis_server.stop()


def test_the_local_tier_keeps_to_its_budget_once_its_copies_are_in_redis(redis_server, tmp_path):
    chain = make_chain(toks(3))
    with TieredStore(
        SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url), TierConfig(cache_bytes=0)
    ) as st:
        sid = st.put_snapshot("doc", FP, chain)
    with SnapshotStore(tmp_path / "a") as local:
        assert local.list_snapshots() == [] and local.du().stored_bytes == 0
    with RedisStore(redis_server.url) as shared:
        assert [s.id for s in shared.list_snapshots()] == [sid]
        assert same_kv(shared.read_chunks_parallel(hashes_of(chain), FP), chain)


def test_chunks_read_through_outlive_the_local_tiers_prunes_under_its_budget(redis_server, tmp_path):
    """They spare the next restore here a read from Redis; the prune after each copy took them all."""
    chain, other = make_chain(toks(4)), make_chain(toks(3, start=500))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
    cfg = TierConfig(readthrough_quiet_s=0, cache_bytes=1 << 30)
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url), cfg) as b:
        assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        read_through(b, chain, 4)
        b.put_snapshot("other", FP, other)  # closing waits for its copy, and the prune after it
    with SnapshotStore(tmp_path / "b") as local:
        assert local.find_longest_prefix(FP, hashes_of(chain)) == 4


def test_snapshots_waiting_for_their_copy_stay_local_whatever_the_budget(redis_server, tmp_path):
    """Pruned here before their copy, they would reach neither tier."""
    chains = [make_chain(toks(3, start=100 * i)) for i in range(3)]
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    with TieredStore(SnapshotStore(tmp_path / "a"), shared, TierConfig(cache_bytes=0)) as st:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            redis_server.kill()
            ids = [st.put_snapshot(f"doc{i}", FP, c) for i, c in enumerate(chains)]
            redis_server.start()
            copied_to(redis_server, *ids)
    with RedisStore(redis_server.url) as shared:
        assert sorted(s.id for s in shared.list_snapshots()) == sorted(ids)


def test_a_save_beside_the_local_prune_keeps_the_chunks_it_brought_from_redis(
    redis_server, tmp_path, monkeypatch
):
    """A save's chunks that only Redis held are copied here first, unnamed by any snapshot until the
    save commits: a prune in between (the tier's, after a copy) must wait for the commit."""
    chain = make_chain(toks(4))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
    budget = TierConfig(cache_bytes=0)
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url), budget) as b:
        put = b.local.put_snapshot

        def put_beside_a_prune(*args, **kwargs):
            pruner = threading.Thread(target=b._fit_cache)
            pruner.start()
            pruner.join(0.5)  # the prune runs now unless it waits for this save
            return put(*args, **kwargs)

        monkeypatch.setattr(b.local, "put_snapshot", put_beside_a_prune)
        grown = b.put_snapshot("grown", FP, [*hashes_of(chain), *make_chain(toks(5))[4:]])
    with RedisStore(redis_server.url) as shared:
        assert grown in [s.id for s in shared.list_snapshots()]


def test_a_restore_leasing_chunks_in_redis_reads_them_there_after_they_reach_the_local_tier(
    redis_server, tmp_path, monkeypatch
):
    """A lazy restore holds its lease while its sequence lives and reads chunks as they are
    selected: read through meanwhile, the local copies are under no lease, and a prune here may take
    them between a read's choice of tier and its files, so its reads stay in the tier it leased."""
    chain = make_chain(toks(4))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
    cfg = TierConfig(readthrough_quiet_s=0)
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url), cfg) as b:
        with b.lease(hashes_of(chain)):
            assert same_kv(b.read_chunks_parallel(hashes_of(chain)[:2], FP), chain[:2])
            read_through(b, chain, 2)
            local_read = b.local.read_chunks_parallel

            def read_after_a_prune(*args, **kwargs):
                b.local.prune(max_bytes=0)
                return local_read(*args, **kwargs)

            monkeypatch.setattr(b.local, "read_chunks_parallel", read_after_a_prune)
            assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)


def test_a_restore_leasing_chunks_in_redis_reads_their_local_copies_while_redis_is_down(
    redis_server, tmp_path
):
    """Reads stay in the tier a lease holds, unless that tier cannot answer: then the local copies
    read through meanwhile serve (unleased here, but there)."""
    chain = make_chain(toks(3))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    with TieredStore(SnapshotStore(tmp_path / "b"), shared, TierConfig(readthrough_quiet_s=0)) as b:
        with b.lease(hashes_of(chain)):
            assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
            read_through(b, chain, 3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                redis_server.kill()
                assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)


def test_a_snapshot_whose_copy_was_dropped_stays_local_whatever_the_budget(redis_server, tmp_path):
    """Past the write-back budget a waiting copy is dropped and its snapshot stays local: the local
    tier's budget, applied after the next copy, must not remove it too."""
    shared = RedisStore(RedisConfig(redis_server.url, retry_s=0.2))
    cfg = TierConfig(writeback_bytes=1, cache_bytes=0)
    with TieredStore(SnapshotStore(tmp_path / "a"), shared, cfg) as st:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            redis_server.kill()
            ids = [st.put_snapshot(f"doc{i}", FP, make_chain(toks(2, start=100 * i))) for i in range(3)]
            redis_server.start()
            copied_to(redis_server, ids[0])
    with SnapshotStore(tmp_path / "a") as local, RedisStore(redis_server.url) as redis:
        here, there = {s.id for s in local.list_snapshots()}, {s.id for s in redis.list_snapshots()}
    assert (here, there) == ({ids[1], ids[2]}, {ids[0]})  # the copied one left the local tier


def round_trips(admin) -> tuple[int, int]:
    """(GETs run, read events on client sockets: a request or a pipeline each), by Redis's own
    INFO since the last CONFIG RESETSTAT."""
    info = admin.info("all")
    return info.get("cmdstat_get", {}).get("calls", 0), info["total_reads_processed"]


def test_a_batch_read_takes_one_get_per_chunk_and_a_fixed_number_of_other_round_trips(redis_server):
    """Each chunk is one GET read straight into its decoder's buffer (a pipeline or MGET of
    multi-MB values was slower); what else a batch asks of Redis (its index rows, pipelined) is a
    fixed number of round trips whatever the batch's size."""
    chain = make_chain(toks(12))
    with RedisStore(redis_server.url) as st:
        st.put_snapshot("doc", FP, chain)
        st.read_chunks_parallel(hashes_of(chain), FP)  # every thread's connection made
        admin, got = redis_server.client(), []
        for n in (2, 12):
            admin.config_resetstat()
            assert same_kv(st.read_chunks_parallel(hashes_of(chain[:n]), FP), chain[:n])
            got.append(round_trips(admin))
        (gets_2, trips_2), (gets_12, trips_12) = got
        assert (gets_2, gets_12) == (2, 12)
        assert trips_2 - gets_2 == trips_12 - gets_12 <= 2  # the rows, INFO


def test_a_blob_refused_mid_read_leaves_nothing_behind_on_the_connection(redis_server):
    """A header refused before the rest of its value is read drops the connection: the next read
    on the pool gets its own reply, not the rest of the refused one."""
    chain = make_chain(toks(3))
    with RedisStore(redis_server.url, workers=1) as st:
        st.put_snapshot("doc", FP, chain)
        key = f"kvflash:blob:{chain[1].chain_hash}"
        data = bytearray(redis_server.client().get(key))
        data[10] ^= 0xFF
        redis_server.client().set(key, bytes(data))
        with pytest.raises(ChunkCorrupt, match="header"):
            st.read_chunk(chain[1].chain_hash, FP)
        assert same_kv([st.read_chunk(chain[0].chain_hash, FP)], chain[:1])
        assert same_kv([st.read_chunk(chain[2].chain_hash, FP)], chain[2:])


def test_a_redis_that_stalls_during_a_read_ends_it_at_the_timeout(tmp_path):
    server = RedisServer(tmp_path / "r", "--enable-debug-command", "yes").start()
    try:
        chain = make_chain(toks(2))
        with RedisStore(RedisConfig(server.url, timeout_s=0.3)) as st:
            st.put_snapshot("doc", FP, chain)
            stall = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", "2"))
            stall.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            with pytest.warns(UserWarning, match="unreachable"), pytest.raises(ChunkUnavailable):
                st.backend.get(chain[0].chain_hash, MAX_FILE_BYTES)
            assert time.monotonic() - t0 < 1.5
            stall.join()
    finally:
        server.stop()


def test_chunks_read_through_wait_while_a_restore_reads(redis_server, tmp_path, monkeypatch):
    """Writing them here would take the cores and the disk from the restore in flight."""
    chain, other = make_chain(toks(4)), make_chain(toks(4, start=500))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
        a.put_snapshot("other", FP, other)
    cfg = TierConfig(readthrough_quiet_s=0)
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url), cfg) as b:
        b.read_chunks_parallel(hashes_of(other), FP)  # the local tier now serves `other`
        read_through(b, other, 4)
        reading, release = threading.Event(), threading.Event()
        local_read = b.local.read_chunks_parallel

        def slow_read(*args, **kwargs):
            reading.set()
            release.wait(10)
            return local_read(*args, **kwargs)

        monkeypatch.setattr(b.local, "read_chunks_parallel", slow_read)
        restore = threading.Thread(target=b.read_chunks_parallel, args=(hashes_of(other), FP))
        restore.start()
        reading.wait(10)
        assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        time.sleep(0.5)
        assert b.local.find_longest_prefix(FP, hashes_of(chain)) == 0, "written during a restore"
        release.set()
        restore.join()
        read_through(b, chain, 4)


def test_chunks_read_through_wait_for_restores_to_be_quiet(redis_server, tmp_path):
    """A turn's prefill and first token come right after its restore."""
    chain = make_chain(toks(3))
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as a:
        a.put_snapshot("doc", FP, chain)
    cfg = TierConfig(readthrough_quiet_s=1.0)
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url), cfg) as b:
        assert same_kv(b.read_chunks_parallel(hashes_of(chain), FP), chain)
        t0 = time.monotonic()
        time.sleep(0.5)
        assert b.local.find_longest_prefix(FP, hashes_of(chain)) == 0, "copied before the quiet time"
        read_through(b, chain, 3)
        assert time.monotonic() - t0 >= 0.9
