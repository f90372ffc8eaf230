"""The disk snapshot store: content addressing, the round trip, summaries, retention and leases, and
processes sharing one store."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from kvflash.storage import (
    ROOT_HASH,
    ChunkCorrupt,
    ChunkMismatch,
    ChunkMissing,
    ForeignFingerprint,
    InvalidChunk,
    InvalidName,
    SnapshotNotFound,
    SnapshotStore,
    StoreError,
    chain_hash,
    chain_hashes,
    codec,
    format,
)
from kvflash.storage.local_backend import LocalDirBackend
from tests.store_util import (
    DTYPES,
    FP,
    B,
    C,
    D,
    H,
    L,
    bits,
    block_summary,
    chain_fields,
    chunk_path,
    damage_at,
    flip,
    forkserver,
    make_chain,
    rewrite_header,
    toks,
    write_version2,
)

# chain hashes and the store's round trip


def test_chain_hash_names_the_whole_prefix() -> None:
    t = toks(3)
    hs = chain_hashes(FP, t, C)
    assert hs == [b.chain_hash for b in make_chain(t)]
    assert len(chain_hashes(FP, t + [1, 2, 3], C)) == 3  # the partial tail has no hash
    other = t[:]
    other[0] += 1
    assert chain_hashes(FP, other, C)[2] != hs[2]  # a change in chunk 0 renames every later chunk
    assert chain_hashes("fp-other", t, C)[0] != hs[0]
    assert chain_hash(bytes.fromhex(ROOT_HASH), FP, t[:C]) == hs[0]
    assert chain_hashes(FP, t[C:], C, parent=hs[0]) == hs[1:]  # a chain continued from its last hash


def test_exists_all_answers_each_hash_as_exists_would(store, tmp_path) -> None:
    """Stored, missing in a fan-out directory that holds others, in one that does not exist, and a
    symlink in place of a chunk file: only the stored regular files exist."""
    hs = [b.chain_hash for b in make_chain(toks(6))]
    store.put_snapshot("doc", FP, make_chain(toks(6)))
    gone, linked = hs[1], hs[2]
    chunk_path(store.root, gone).unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(chunk_path(store.root, linked).read_bytes())
    chunk_path(store.root, linked).unlink()
    chunk_path(store.root, linked).symlink_to(target)
    fans = store.root / "chunks"
    absent = next(f"{d:02x}" + "0" * 62 for d in range(256) if not (fans / f"{d:02x}").exists())
    asked = [*hs, absent]
    expected = [h not in (gone, linked) for h in hs] + [False]
    assert store.backend.exists_all(asked) == expected
    assert [store.backend.exists(h) for h in asked] == expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec_name", ["lossless", "fp8"])
def test_store_round_trip(tmp_path, dtype, codec_name) -> None:
    blobs = make_chain(toks(3), dtype=dtype)
    with SnapshotStore(tmp_path, codec=codec_name, level=1, workers=2) as st:
        sid = st.put_snapshot("doc", FP, blobs, meta={"turns": [12, 40]})
        snap = st.get_snapshot(sid)
        assert snap.n_tokens == 3 * C and snap.n_chunks == 3 and snap.meta == {"turns": [12, 40]}
        got = st.read_chunks_parallel(snap.chunk_hashes, FP, expect_shape=(L, 2, H, C, D), expect_dtype=dtype)
        for a, b in zip(blobs, got, strict=True):
            assert (b.index, b.chain_hash, b.parent_hash, b.tokens) == (
                a.index,
                a.chain_hash,
                a.parent_hash,
                a.tokens,
            )
            assert torch.equal(b.summary, a.summary) and b.kv.dtype == dtype
            if codec_name == "lossless":
                assert torch.equal(bits(b.kv), bits(a.kv))
            else:
                assert float(codec.fp8_error(a.kv, b.kv).max()) <= 2**-4 + 2**-7
        with pytest.raises(ChunkMismatch, match="shape"):
            st.read_chunk(snap.chunk_hashes[0], FP, expect_shape=(L, 2, H, C, D + 1))
        assert st.find_longest_prefix(FP, snap.chunk_hashes) == 3  # a caller's mismatch is no damage


def test_restore_into_given_tensors_only_after_every_check(store) -> None:
    blobs = make_chain(toks(3))
    sid = store.put_snapshot("s", FP, blobs)
    hs = store.get_snapshot(sid).chunk_hashes
    outs = [torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16) for _ in hs]
    got = store.read_chunks_parallel(hs, FP, out=outs)
    assert all(g.kv is o for g, o in zip(got, outs, strict=True))
    assert all(torch.equal(bits(o), bits(b.kv)) for o, b in zip(outs, blobs, strict=True))
    wrong = torch.zeros(L, 2, H, C, D, dtype=torch.float16)
    with pytest.raises(ChunkMismatch, match="dtype"):
        store.read_chunk(hs[0], FP, out=wrong)
    with pytest.raises(StoreError, match="contiguous"):
        store.read_chunks_parallel(hs[:1], FP, out=[outs[0].transpose(3, 4)])
    flip(chunk_path(store.root, hs[2]), -10)
    dest = torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16)
    with pytest.raises(ChunkCorrupt):
        store.read_chunk(hs[2], FP, out=dest)
    assert torch.count_nonzero(dest) == 0


@pytest.mark.parametrize("version", [3, 2])
def test_a_read_without_summaries_gives_the_kv_and_tokens_of_a_full_read(store, version) -> None:
    blobs = make_chain(toks(3))
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    if version == 2:
        write_version2(store.root, blobs)
    assert store.read_header(hs[0]).version == version
    full = store.read_chunks_parallel(hs, FP)
    outs = [torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16) for _ in hs]
    bare = store.read_chunks_parallel(hs, FP, out=outs, with_summary=False)
    one = store.read_chunk(hs[1], FP, with_summary=False)
    for f, g, o in zip(full, bare, outs, strict=True):
        assert f.summary is not None and g.summary is None and g.kv is o
        assert chain_fields(g) == chain_fields(f) and torch.equal(bits(g.kv), bits(f.kv))
    assert one.summary is None and chain_fields(one) == chain_fields(full[1])
    assert torch.equal(bits(one.kv), bits(full[1].kv))
    with pytest.raises(InvalidChunk, match="no summary"):
        store.put_snapshot("again", FP, bare)


@pytest.mark.parametrize("where", ["token id", "kv", "summary residual"])
def test_a_read_without_summaries_refuses_damage_all_the_same(store, where) -> None:
    blobs = make_chain(toks(3))
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    flip(chunk_path(store.root, hs[1]), damage_at(store.read_header(hs[1]), where))
    outs = [torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16) for _ in hs]
    with pytest.raises(ChunkCorrupt, match=hs[1][:16]):
        store.read_chunks_parallel(hs, FP, out=outs, with_summary=False)
    assert not outs[1].any(), "a damaged chunk's destination is never written"


def test_a_summary_that_fails_its_check_leaves_the_destination_unwritten(store) -> None:
    """A version 3 file whose rebuilt summary does not match its meta crc is refused before the
    KV, decoded by then, reaches `out`, and is marked damaged for the reads after it."""
    blobs = make_chain(toks(2))
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    rewrite_header(chunk_path(store.root, hs[1]), meta_crc=store.read_header(hs[1]).meta_crc ^ 1)
    out = torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16)
    with pytest.raises(ChunkCorrupt, match="token/summary checksum"):
        store.read_chunk(hs[1], FP, out=out)
    assert not out.any(), "a refused chunk's destination is never written"
    with pytest.raises(ChunkCorrupt, match="found damaged earlier"):
        store.read_chunk(hs[1], FP, out=out, with_summary=False)


def test_a_restore_does_not_wait_for_its_read_ahead_hint(tmp_path) -> None:
    """The hint for a batch blocks once the disk's queue is full; the reads and decodes must go on
    meanwhile (waiting for it holds a 1,024-chunk restore well under the disk's read speed:
    docs/BENCHMARKS.md, Snapshot store)."""
    release = threading.Event()
    hinted: list[list[str]] = []

    class StuckHints(LocalDirBackend):
        def will_need(self, chunk_hashes):
            release.wait(10)
            hinted.append(list(chunk_hashes))
            super().will_need(chunk_hashes)

    blobs = make_chain(toks(4))
    with SnapshotStore(tmp_path, workers=2, backend=StuckHints(tmp_path)) as st:
        hs = st.get_snapshot(st.put_snapshot("s", FP, blobs)).chunk_hashes
        got = st.read_chunks_parallel(hs, FP)
        assert not release.is_set() and not hinted  # the restore finished while its hint was stuck
        assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(got, blobs, strict=True))
        release.set()
    assert hinted == [list(hs)]  # closing the store let the hint finish


def test_a_blob_repr_names_the_chunk_without_its_tensors() -> None:
    blob = make_chain(toks(1))[0]
    text = repr(blob)
    assert blob.chain_hash in text and "tensor" not in text and len(text) < 300


def test_pool_map_keeps_order_and_raises_the_earliest_failure(store) -> None:
    """The pool's threads take indices as they go; whichever fails first in time, the caller gets
    the failure of the earliest index, as from running them one by one, and no thread takes a new
    index after a failure."""
    assert store.threads.map(lambda i: i * i, 7) == [i * i for i in range(7)]
    assert store.threads.map(lambda i: i, 0) == []
    calls = []

    def fn(i: int) -> int:
        calls.append(i)
        if i == 0:
            time.sleep(0.2)  # index 1 fails first
        if i in (0, 1):
            raise ChunkCorrupt(str(i) * 64, "bad")
        return i

    with pytest.raises(ChunkCorrupt) as e:
        store.threads.map(fn, 100)
    assert e.value.chunk_hash == "0" * 64
    assert len(calls) < 100


def test_summaries_are_read_without_the_kv(store) -> None:
    blobs = make_chain(toks(3))
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    got = store.read_summaries(hs, FP)
    assert store.read_header(hs[0]).summary_shape == (L, H, B, D)
    for g, b in zip(got, blobs, strict=True):
        assert g.summary.shape == (L, H, B, D) and g.summary.dtype == torch.float32
        for name in ("index", "chain_hash", "parent_hash", "tokens"):
            assert getattr(g, name) == getattr(b, name)
        assert torch.equal(g.summary, b.summary)
    # the chunk files (what a snapshot without a summaries file is read from): the summary comes
    # back with the KV, so damage to either refuses it
    got = store.chunk_summaries(hs, FP)
    assert all(torch.equal(g.summary, b.summary) for g, b in zip(got, blobs, strict=True))
    flip(chunk_path(store.root, hs[0]), -10)
    with pytest.raises(ChunkCorrupt):
        store.chunk_summaries(hs[:1], FP)
    with pytest.raises(ForeignFingerprint):
        store.read_summaries(hs, "fp-other")


def test_version_2_files_read_their_summary_section_without_the_kv(store) -> None:
    blobs = make_chain(toks(3))
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    write_version2(store.root, blobs)
    assert store.read_header(hs[0]).version == 2
    got = store.chunk_summaries(hs, FP)
    assert all(torch.equal(g.summary, b.summary) for g, b in zip(got, blobs, strict=True))
    read = store.read_chunks_parallel(hs, FP)
    assert all(torch.equal(bits(g.kv), bits(b.kv)) for g, b in zip(read, blobs, strict=True))
    flip(chunk_path(store.root, hs[0]), -10)  # payload: found when the KV itself is read
    assert store.chunk_summaries(hs[:1], FP)[0].tokens == blobs[0].tokens
    flip(chunk_path(store.root, hs[1]), format.HEADER_SIZE + 4 * C + 3)  # summary
    with pytest.raises(ChunkCorrupt, match="summary"):
        store.chunk_summaries(hs, FP)


def test_summaries_fill_out_rows_in_order_whatever_the_section_length(store) -> None:
    short = make_chain(toks(5), blocks=1)
    long = make_chain(toks(7, start=1000), blocks=C)  # longer sections than the last read predicted
    for blobs in (short, long, short):
        hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
        b = blobs[0].summary.shape[2]
        out = torch.full((len(hs), L, H, b, D), float("nan"))
        got = store.read_summaries(hs, FP, out)
        assert [g.chain_hash for g in got] == list(hs)
        assert [g.tokens for g in got] == [x.tokens for x in blobs]
        assert torch.equal(out, torch.stack([x.summary for x in blobs]))
        assert all(g.summary.data_ptr() == row.data_ptr() for g, row in zip(got, out, strict=True))
    with pytest.raises(ChunkMismatch, match="summary shape"):
        store.read_summaries(hs[:1], FP, torch.empty(1, L, H, C, D))


@pytest.mark.parametrize("blocks", [1, 2, C])
def test_summary_blocks_round_trip(store, blocks) -> None:
    blobs = make_chain(toks(2), blocks=blocks)
    hs = store.get_snapshot(store.put_snapshot("s", FP, blobs)).chunk_hashes
    h = store.read_header(hs[0])
    assert h.summary_blocks == blocks and h.summary_shape == (L, H, blocks, D)
    assert h.version == 3 and h.file_len == format.HEADER_SIZE + 4 * C + h.stored_len  # summary in payload
    for got in (store.read_chunks_parallel(hs, FP), store.read_summaries(hs, FP)):
        assert all(torch.equal(g.summary, b.summary) for g, b in zip(got, blobs, strict=True))


def test_index_is_wal(store) -> None:
    assert store.index.db.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_shared_chunks_are_stored_once(store, monkeypatch) -> None:
    puts: list[str] = []
    real_put = store.backend.put
    monkeypatch.setattr(store.backend, "put", lambda h, parts: (puts.append(h), real_put(h, parts)))
    a = store.put_snapshot("a", FP, make_chain(toks(4)))
    assert len(puts) == 4
    b_tokens = toks(2) + toks(2, start=1000)  # shares chunks 0 and 1 with a
    b = store.put_snapshot("b", FP, make_chain(b_tokens))
    assert len(puts) == 6
    sa, sb = store.get_snapshot(a), store.get_snapshot(b)
    assert sa.chunk_hashes[:2] == sb.chunk_hashes[:2] and sa.chunk_hashes[2] != sb.chunk_hashes[2]
    rows = store.index.all_chunk_rows()
    assert len(rows) == 6 and len(list(store.backend.list_hashes())) == 6
    assert [rows[h].refcount for h in sb.chunk_hashes] == [2, 2, 1, 1]
    store.rm(a)
    rows = store.index.all_chunk_rows()
    assert set(rows) == set(sb.chunk_hashes) and all(r.refcount == 1 for r in rows.values())
    assert sorted(store.backend.list_hashes()) == sorted(sb.chunk_hashes)
    assert store.verify().ok


class Listing(LocalDirBackend):
    """The disk backend, counting the walks over every file of the store (`_entries`)."""

    def __init__(self, root):
        super().__init__(root)
        self.walks = 0

    def _entries(self):
        self.walks += 1
        return super()._entries()


def test_rm_reads_and_sweeps_only_the_snapshot_it_removes(tmp_path) -> None:
    """A session's every save removes the snapshot it replaces: `rm` walks no file of the store but
    its own and asks the index of that snapshot's chunks alone, yet frees exactly what the
    whole-store policy frees and reports the store's remaining bytes; an orphan a crash left stays
    for the next prune."""
    root = tmp_path / "store"
    with SnapshotStore(root, backend=Listing(root)) as st:
        for d in range(3):
            st.put_snapshot(f"doc {d}", FP, make_chain(toks(5, start=1000 * (d + 1))))
        a = st.put_snapshot("a", FP, make_chain(toks(4)))
        b = st.put_snapshot("b", FP, make_chain(toks(2) + toks(2, start=500)))  # shares 2 with a
        sa, sb = st.get_snapshot(a), st.get_snapshot(b)
        orphan = make_chain(toks(1, start=9000))[0]
        st.backend.put(orphan.chain_hash, format.encode_chunk(orphan, codec.Codec.LOSSLESS, 1)[:2])
        st.backend.walks = 0
        report = st.rm(a)
        assert st.backend.walks == 0
        assert report.chunks == 2 and report.swept_files == 1  # a's own two chunks and its file
        assert report.remaining_bytes == st.du().stored_bytes
        assert not st.backend.exists(sa.chunk_hashes[3]) and all(map(st.backend.exists, sb.chunk_hashes))
        assert not st.backend.path(sa.chunk_hashes[-1], ".kvs").exists()
        assert [st.index.all_chunk_rows()[h].refcount for h in sb.chunk_hashes] == [1, 1, 1, 1]
        assert st.backend.exists(orphan.chain_hash) and st.prune().swept_files == 1
        assert st.verify().ok


@pytest.mark.parametrize("save_threads", [None, 2])
def test_a_save_encodes_at_most_save_threads_chunks_at_once(tmp_path, monkeypatch, save_threads) -> None:
    """A server's saves run beside its scheduler: `save_threads` bounds the store threads a save keeps
    busy; without it a save takes all of them."""
    with SnapshotStore(tmp_path / "store", workers=4, save_threads=save_threads) as st:
        busy, peak, lock = 0, 0, threading.Lock()
        real = st.writer._store_one

        def counted(item):
            nonlocal busy, peak
            with lock:
                busy += 1
                peak = max(peak, busy)
            try:
                time.sleep(0.02)  # long enough for every thread the save allows to be at work at once
                return real(item)
            finally:
                with lock:
                    busy -= 1

        monkeypatch.setattr(st.writer, "_store_one", counted)
        sid = st.put_snapshot("a", FP, make_chain(toks(12)))
        assert peak == (save_threads or 4)
        assert len(st.get_snapshot(sid).chunk_hashes) == 12 and st.verify().ok


def test_a_save_yielding_to_first_tokens_encodes_once_they_are_out(tmp_path) -> None:
    """A server's saves wait for its quiet moments (no request waiting for a first token): while
    the event is clear nothing is encoded, once set the save ends; and the wait is bounded, so a
    save still ends under a server that is never quiet."""
    with SnapshotStore(tmp_path / "store", workers=2, save_threads=2) as st:
        quiet = threading.Event()
        st.yield_saves_to(quiet, 60.0)
        saved: list[str] = []
        saver = threading.Thread(target=lambda: saved.append(st.put_snapshot("a", FP, make_chain(toks(4)))))
        saver.start()
        saver.join(0.3)
        assert saver.is_alive() and not list(st.backend.list_hashes())
        quiet.set()
        saver.join(30)
        assert len(st.get_snapshot(saved[0]).chunk_hashes) == 4

        st.yield_saves_to(threading.Event(), 0.2)  # never set: each save waits 0.2 s in all
        sid = st.put_snapshot("b", FP, make_chain(toks(4, start=1000)))
        assert len(st.get_snapshot(sid).chunk_hashes) == 4 and st.verify().ok


def test_grown_prefix_is_resnapshotted_by_hash(store) -> None:
    t = toks(5)
    blobs = make_chain(t)
    store.put_snapshot("turn 1", FP, blobs[:3])
    hs = chain_hashes(FP, t, C)
    n = store.find_longest_prefix(FP, hs)
    assert n == 3
    sid = store.put_snapshot("turn 2", FP, hs[:n] + blobs[n:])
    assert store.get_snapshot(sid).chunk_hashes == tuple(hs)
    assert store.find_longest_prefix(FP, hs) == 5
    assert store.find_longest_prefix("fp-other", hs) == 0
    with pytest.raises(InvalidChunk, match="chain"):
        store.put_snapshot("gap", FP, [hs[0], hs[2]])
    with pytest.raises(ChunkMissing):
        store.put_snapshot("unknown", FP, [chain_hash(ROOT_HASH, FP, toks(1, start=99))])


def test_put_refuses_chunks_that_do_not_chain(store) -> None:
    blobs = make_chain(toks(3))
    with pytest.raises(InvalidChunk):
        store.put_snapshot("skip", FP, [blobs[0], blobs[2]])
    with pytest.raises(InvalidChunk):
        store.put_snapshot("start late", FP, blobs[1:])
    with pytest.raises(InvalidChunk, match="fingerprint"):
        store.put_snapshot("other fp", "fp-other", blobs)
    bad = make_chain(toks(1))[0]
    bad.tokens[0] += 1
    with pytest.raises(InvalidChunk, match="chain hash"):
        store.put_snapshot("tampered", FP, [bad])
    short = make_chain(toks(1))[0]
    short.kv = short.kv[:, :, :, :8]
    with pytest.raises(InvalidChunk, match="tokens"):
        store.put_snapshot("short", FP, [short])
    for summary, message in (
        (blobs[0].kv[:, 0].float().mean(dim=2), "summary must be"),  # the old [L, Hkv, D]
        (torch.zeros(L, H, 3, D), "summary blocks"),  # 3 does not divide 16
        (torch.zeros(L, H, 0, D), "summary blocks"),
        (torch.zeros(L, H, B, D, dtype=torch.float16), "fp32"),
        (torch.zeros(L, H + 1, B, D), "summary must be"),
    ):
        odd = make_chain(toks(1))[0]
        odd.summary = summary
        with pytest.raises(InvalidChunk, match=message):
            store.put_snapshot("odd summary", FP, [odd])
    mixed = make_chain(toks(2))
    mixed[1].summary = block_summary(mixed[1].kv, 2)
    with pytest.raises(InvalidChunk, match="summary blocks differ"):
        store.put_snapshot("mixed", FP, mixed)
    with pytest.raises(InvalidChunk, match="nothing"):
        store.put_snapshot("empty", FP, [])
    with pytest.raises(StoreError, match="JSON"):
        store.put_snapshot("meta", FP, blobs, meta={"x": object()})
    assert store.list_snapshots() == [] and list(store.backend.list_hashes()) == []


# retention


def _age(store: SnapshotStore, sid: str, seconds: float) -> None:
    store.index.db.conn.execute("UPDATE snapshots SET last_used = last_used - ? WHERE id = ?", (seconds, sid))


def test_a_snapshot_that_succeeds_others_starts_with_their_hits(store) -> None:
    blobs = make_chain(toks(3))
    a = store.put_snapshot("s", FP, blobs[:2])
    b = store.put_snapshot("s", FP, blobs[:1])
    store.record_hit([blobs[0].chain_hash])  # a restore of one chunk: a and b hold it at position 0
    store.record_hit([blobs[0].chain_hash, blobs[1].chain_hash])  # a restore of a
    c = store.put_snapshot("s", FP, blobs, succeeds=[a, b])
    hits = {s.id: s.hits for s in store.list_snapshots()}
    assert hits == {a: 2, b: 1, c: 3}
    d = store.put_snapshot("t", FP, blobs)  # succeeds nothing: starts at zero
    assert {s.id: s.hits for s in store.list_snapshots()}[d] == 0
    with pytest.raises(InvalidName):
        store.put_snapshot("s", FP, blobs, succeeds=["../x"])


def test_prune_is_lru_first_and_skips_pins_and_leases(store) -> None:
    ids = [store.put_snapshot(f"s{i}", FP, make_chain(toks(2, start=1000 * i))) for i in range(4)]
    for i, sid in enumerate(ids):
        _age(store, sid, 100 - i)  # s0 oldest
    store.record_hit(store.get_snapshot(ids[0]).chunk_hashes)  # now s0 is the most recent
    assert store.get_snapshot(ids[0]).hits == 1
    per = store.get_snapshot(ids[1]).stored_bytes
    total = store.du().stored_bytes

    plan = store.prune(max_bytes=total - per, dry_run=True)
    assert plan.snapshots == [ids[1]] and plan.freed_bytes == per
    assert len(store.list_snapshots()) == 4  # a dry run changes nothing

    store.pin(ids[2])
    leased = store.get_snapshot(ids[3]).chunk_hashes
    with store.lease(leased):
        report = store.prune(max_bytes=0)
        assert report.snapshots == [ids[1], ids[0]]
        assert {s.id for s in store.list_snapshots()} == {ids[2], ids[3]}
        assert len(store.read_chunks_parallel(leased, FP)) == 2
    assert store.prune(max_bytes=0).snapshots == [ids[3]]
    assert [s.id for s in store.list_snapshots()] == [ids[2]]
    with pytest.raises(StoreError, match="pinned"):
        store.rm(ids[2])
    store.unpin(ids[2])
    assert store.prune(max_bytes=0).snapshots == [ids[2]]
    assert store.du().stored_bytes == 0 and list(store.backend.list_hashes()) == []


def test_chunks_no_snapshot_names_go_first_and_only_as_the_budget_needs(store, tmp_path) -> None:
    """A tier's read-through chunks (indexed without a snapshot) spare its next restore a read
    from the shared tier: a prune under budget keeps them, over it takes the least recently used
    of them before any snapshot; a prune with no budget or cutoff collects them all."""
    sid = store.put_snapshot("kept", FP, make_chain(toks(2)))
    loose = make_chain(toks(3, start=500))
    with SnapshotStore(tmp_path / "other") as other:
        other.put_snapshot("x", FP, loose)
        store.copy_in((b.chain_hash, other.chunk_file(b.chain_hash)) for b in loose)
    conn = store.index.db.conn
    for age, b in zip((300, 100, 200), loose, strict=True):
        conn.execute("UPDATE chunks SET last_used = last_used - ? WHERE hash = ?", (age, b.chain_hash))
    total, per = store.du().stored_bytes, store.index.chunk_rows([loose[0].chain_hash])[loose[0].chain_hash]
    assert store.prune(max_bytes=total).chunks == 0
    report = store.prune(max_bytes=total - 2 * per.stored_bytes)
    assert report.snapshots == [] and report.chunks == 2
    assert set(store.index.chunk_rows([b.chain_hash for b in loose])) == {loose[1].chain_hash}
    assert store.prune(older_than=150).chunks == 0  # the one left was used 100 s ago
    assert store.prune().chunks == 1 and [s.id for s in store.list_snapshots()] == [sid]


def test_prune_by_age(store) -> None:
    old, new = (store.put_snapshot(n, FP, make_chain(toks(1, start=s))) for n, s in (("old", 0), ("new", 50)))
    _age(store, old, 8 * 86400)
    assert store.prune(older_than=7 * 86400).snapshots == [old]
    assert [s.id for s in store.list_snapshots()] == [new]


def test_leased_chunks_outlive_their_snapshot(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    hs = store.get_snapshot(sid).chunk_hashes
    with store.lease(hs):
        store.rm(sid)
        assert len(store.read_chunks_parallel(hs, FP)) == 2
    assert store.prune().chunks == 2 and store.du().chunks == 0
    with pytest.raises(ChunkMissing):
        with store.lease(hs):
            pass


def _hold_lease(root: str, hashes: list[str], ready) -> None:
    st = SnapshotStore(root)
    with st.lease(hashes):
        ready.set()
        time.sleep(60)


def test_lease_of_another_process_is_honoured_until_it_dies(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    hs = list(store.get_snapshot(sid).chunk_hashes)
    ctx = forkserver()
    ready = ctx.Event()
    p = ctx.Process(target=_hold_lease, args=(str(store.root), hs, ready))
    p.start()
    try:
        assert ready.wait(30)
        store.rm(sid)
        assert store.prune().chunks == 0  # leased by a live process
        assert len(store.read_chunks_parallel(hs, FP)) == 2
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    assert store.prune().chunks == 2  # its pid is gone: the lease is dead


# concurrency


def _worker(root: str, seed: int, rounds: int) -> None:
    """Saves snapshots sharing a prefix with the other worker's, reads under leases, prunes."""
    rng = random.Random(seed)
    st = SnapshotStore(root, workers=2)
    for r in range(rounds):
        shared = rng.randrange(3)
        t = toks(2, start=100 * shared) + toks(rng.randrange(1, 4), start=10_000 * seed + 100 * r)
        st.put_snapshot(f"w{seed}-{r}", FP, make_chain(t))
        snaps = st.list_snapshots()
        try:
            hs = st.get_snapshot(rng.choice(snaps).id).chunk_hashes if snaps else ()
            with st.lease(hs):
                got = st.read_chunks_parallel(hs, FP)
        except (SnapshotNotFound, ChunkMissing):
            continue  # pruned by the other process between list and lease: a cold prefill
        assert [b.chain_hash for b in got] == list(hs)
        if r % 4 == 3:
            st.prune(max_bytes=40_000)
    st.close()


def test_two_processes_share_one_store(store) -> None:
    ctx = forkserver()
    procs = [ctx.Process(target=_worker, args=(str(store.root), seed, 16)) for seed in (1, 2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    report = store.verify()
    assert report.ok, report
    assert store.du().damaged_chunks == 0
    assert set(store.backend.list_hashes()) == set(store.index.all_chunk_rows())
