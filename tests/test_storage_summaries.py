"""Summaries files (kvflash/storage/summaries.py): a lazy restore reads a snapshot's token ids and
summaries from one file in one read, and so does a turn-2 prompt for the prefix it shares with a
snapshot; a file that is damaged, truncated, missing or another chain's costs only the fallback to
the chunk files (same result, nothing marked damaged, `verify` names it and writes it again);
removals take it with the last snapshot of its chain; a store written without them restores as
before. Reads are counted by a real backend subclass over real files; the shared tier runs on a real
redis-server."""

from __future__ import annotations

import shutil
import zlib
from collections import Counter

import numpy as np
import pytest
import torch

from kvflash.serve.prefix_cache import PrefixCache
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import SnapshotStore, summaries
from kvflash.storage.chunk import token_bytes
from kvflash.storage.format import with_crc
from kvflash.storage.local_backend import LocalDirBackend
from kvflash.storage.redis_store import RedisStore
from kvflash.storage.summaries import SUMMARIES_HEADER_SIZE, entry_crc
from kvflash.storage.tiered import TieredStore
from tests.store_util import FP, C, bits, make_chain, toks
from tests.test_restore import FP as MODEL_FP
from tests.test_restore import engine as tiny_engine
from tests.test_restore import lm, prompt, saved  # noqa: F401 (lm: the tiny model's fixture)


class Counting(LocalDirBackend):
    """The disk backend, counting its reads of chunk-file sections (`get_range`, what a per-chunk
    summaries read does) and of summaries files."""

    def __init__(self, root):
        super().__init__(root)
        self.calls: Counter[str] = Counter()

    def get_range(self, chunk_hash, start, length):
        self.calls["get_range"] += 1
        return super().get_range(chunk_hash, start, length)

    def get_summaries(self, last_hash, head, plan):
        self.calls["get_summaries"] += 1
        return super().get_summaries(last_hash, head, plan)


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2, backend=Counting(root)) as st:
        yield st


def hashes_of(blobs) -> list[str]:
    return [b.chain_hash for b in blobs]


def sums_path(store: SnapshotStore, last: str):
    return store.backend.path(last, ".kvs")


def same(got, want) -> bool:
    """Summaries alike in position, chain, tokens and every bit of the summary."""
    return len(got) == len(want) and all(
        (g.index, g.chain_hash, g.parent_hash, g.tokens) == (w.index, w.chain_hash, w.parent_hash, w.tokens)
        and torch.equal(bits(g.summary), bits(w.summary))
        for g, w in zip(got, want, strict=True)
    )


def reads(store: SnapshotStore, hashes, fp=FP, out=None):
    """read_summaries and the backend reads it took."""
    store.backend.calls.clear()
    got = store.read_summaries(hashes, fp, out)
    return got, dict(store.backend.calls)


def test_a_snapshots_summaries_are_one_read_of_one_file_straight_into_the_rows(store) -> None:
    blobs = make_chain(toks(40))
    hs = hashes_of(blobs)
    store.put_snapshot("doc", FP, blobs)
    assert sums_path(store, hs[-1]).is_file()
    out = torch.full((40, *blobs[0].summary.shape), float("nan"))
    got, calls = reads(store, hs, out=out)
    assert calls == {"get_summaries": 1}  # no chunk file read
    assert same(got, store.chunk_summaries(hs, FP))
    assert torch.equal(out, torch.stack([b.summary for b in blobs]))
    assert all(g.summary.data_ptr() == row.data_ptr() for g, row in zip(got, out, strict=True))
    head, calls = reads(store, hs[:7])  # a prompt that shares 7 chunks with the snapshot
    assert calls == {"get_summaries": 1} and same(head, got[:7])


def version1_file(blobs) -> bytes:
    """The summaries file format version 1 wrote: header, checksum table, token ids, summaries as
    they are."""
    tokens = [token_bytes(b.tokens) for b in blobs]
    rows = [b.summary.numpy().astype("<f4").tobytes() for b in blobs]
    table = np.asarray([entry_crc(t, r) for t, r in zip(tokens, rows, strict=True)], dtype="<u4").tobytes()
    shape = tuple(blobs[0].summary.shape)
    last = blobs[-1].chain_hash
    fields = (summaries.MAGIC, 1, FP.encode(), bytes.fromhex(last), len(blobs), C, *shape, zlib.crc32(table))
    return with_crc(summaries._HEADER.pack(*fields)) + table + b"".join(tokens) + b"".join(rows)


def test_a_version_1_file_reads_as_before_and_version_2_is_smaller(store) -> None:
    blobs = make_chain(toks(8))
    hs = hashes_of(blobs)
    store.put_snapshot("doc", FP, blobs)
    path = sums_path(store, hs[-1])
    old = version1_file(blobs)
    assert path.stat().st_size < 0.8 * len(old)  # block means of bf16 keys: low bytes mostly zero
    path.write_bytes(old)
    got, calls = reads(store, hs[:5])
    assert calls == {"get_summaries": 1} and same(got, store.chunk_summaries(hs[:5], FP))
    assert store.verify().summaries == []


def test_a_grown_chain_reads_its_prefix_from_the_file_of_the_snapshot_it_extends(store) -> None:
    first, longer = make_chain(toks(6)), make_chain(toks(9))
    store.put_snapshot("turn 1", FP, first)
    store.backend.calls.clear()
    store.put_snapshot("turn 2", FP, [*hashes_of(first), *longer[6:]])  # as a session's next save
    assert store.backend.calls["get_range"] == 0
    got, calls = reads(store, hashes_of(longer))
    assert calls == {"get_summaries": 1} and same(got, store.chunk_summaries(hashes_of(longer), FP))


def frames(path) -> list[bytes]:
    """Each entry's summary frame in a version 2 file, as stored."""
    data = path.read_bytes()
    h = summaries.parse_summaries_header(data[:SUMMARIES_HEADER_SIZE], len(data), path.stem)
    ends, _ = summaries.check_table(h, data[SUMMARIES_HEADER_SIZE : h.tokens_at], path.stem)
    starts = [h.summaries_at, *ends[:-1].tolist()]
    return [data[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]


def test_a_save_extending_a_stored_chain_copies_its_summaries_frames_as_stored(tmp_path) -> None:
    """A turn's save extends the chain it restored: the new chain's file takes the stored file's
    entries byte for byte (here written at another zstd level, so a compression again would differ)
    and compresses only the chunks the save wrote; it reads as the chunk files do."""
    first, longer = make_chain(toks(6)), make_chain(toks(9))
    assert summaries.summary_frame(first[0].summary, -7) != summaries.summary_frame(first[0].summary, 19)
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2, level=-7) as st:
        st.put_snapshot("turn 1", FP, first)
    with SnapshotStore(root, workers=2, level=19, backend=Counting(root)) as st:
        st.put_snapshot("turn 2", FP, [*hashes_of(first), *longer[6:]])
        assert st.backend.calls == {"get_summaries": 2}  # the new file's header, the old file's head
        old, new = frames(sums_path(st, first[-1].chain_hash)), frames(sums_path(st, longer[-1].chain_hash))
        assert new[:6] == old
        assert new[6:] == [summaries.summary_frame(b.summary, 19) for b in longer[6:]]
        got, calls = reads(st, hashes_of(longer))
        assert calls == {"get_summaries": 1} and same(got, st.chunk_summaries(hashes_of(longer), FP))
        assert st.verify().summaries == []


def test_a_save_whose_stored_file_is_gone_takes_the_summaries_its_restore_read(store, tmp_path) -> None:
    """A session's next save passes the summaries its restore read (`known`): where the file of the
    chain it extends is gone, the new file is written from them, without a read of the chunk files,
    and holds what a save that copies the stored file writes."""
    first, longer = make_chain(toks(6)), make_chain(toks(9))
    store.put_snapshot("turn 1", FP, first)
    known = store.read_summaries(hashes_of(first), FP)
    sums_path(store, first[-1].chain_hash).unlink()
    store.backend.calls.clear()
    store.put_snapshot("turn 2", FP, [*hashes_of(first), *longer[6:]], known=known)
    assert store.backend.calls == {"get_summaries": 2}  # the new file's header, the missing file
    root = tmp_path / "other"
    with SnapshotStore(root, workers=2, backend=Counting(root)) as other:  # the same save, copying
        other.put_snapshot("turn 1", FP, first)
        other.put_snapshot("turn 2", FP, [*hashes_of(first), *longer[6:]])
        want = sums_path(other, longer[-1].chain_hash).read_bytes()
    assert sums_path(store, longer[-1].chain_hash).read_bytes() == want


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _damage(store: SnapshotStore, kind: str, blobs, other) -> str:
    """Damages the summaries file of blobs' chain one way; the reason verify gives for it."""
    last = blobs[-1].chain_hash
    path = sums_path(store, last)
    size = path.stat().st_size
    if kind == "summary bit":
        flip(path, size - 5)  # inside entry 4's frame
        return "entry 4: zstd"
    if kind == "token bit":
        flip(path, SUMMARIES_HEADER_SIZE + 12 * 5 + 4 * C + 2)  # entry 1's ids
        return "entry 1 is not chunk"
    if kind == "header bit":
        flip(path, 30)
        return "header checksum mismatch"
    if kind == "huge shape":  # a header that lies consistently: its checksum matches
        data = bytearray(path.read_bytes())
        fields = list(summaries._HEADER.unpack_from(data))
        fields[6], fields[7], fields[9] = 4096, 4096, 1 << 14  # L, Hkv, D at their caps
        data[:SUMMARIES_HEADER_SIZE] = with_crc(summaries._HEADER.pack(*fields))
        path.write_bytes(bytes(data))
        return f"5 summaries of {4096 * 4096 * fields[8] * (1 << 14) * 4} bytes in {size} bytes"
    if kind == "table bit":
        flip(path, SUMMARIES_HEADER_SIZE + 1)
        return "checksum table mismatch"
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: size - 100])
        return "past the file"
    if kind == "missing":
        path.unlink()
        return "file missing"
    if kind == "another chain":
        shutil.copy(sums_path(store, other[-1].chain_hash), path)
        return "holds the chain ending at"
    assert kind == "another fingerprint"
    entries = [(b.tokens, b.summary) for b in blobs]
    store.backend.put_summaries(last, store.writer.summaries_parts("fp-other", last, entries))
    return "made under fp-other"


KINDS = [
    "summary bit",
    "token bit",
    "header bit",
    "huge shape",
    "table bit",
    "truncated",
    "missing",
    "another chain",
    "another fingerprint",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_summaries_file_falls_back_to_the_chunk_files_and_verify_rewrites_it(store, kind) -> None:
    blobs, other = make_chain(toks(5)), make_chain(toks(5, start=500))
    hs = hashes_of(blobs)
    sid = store.put_snapshot("doc", FP, blobs)
    store.put_snapshot("other", FP, other)
    want = store.chunk_summaries(hs, FP)
    reason = _damage(store, kind, blobs, other)
    got, calls = reads(store, hs)
    assert same(got, want) and calls["get_range"] >= len(hs)  # per chunk, same result
    assert all(r.damaged is None for r in store.index.chunk_rows(hs).values())  # no chunk is to blame
    report = store.verify()
    assert report.ok, report  # nothing is lost
    (found,) = report.summaries
    assert found.chunk_hash == hs[-1] and found.snapshots == (sid,)
    assert reason in found.reason and found.reason.endswith("written again from the chunk files")
    assert store.verify().summaries == []
    got, calls = reads(store, hs)
    assert calls == {"get_summaries": 1} and same(got, want)


def test_a_store_written_without_summaries_files_restores_and_gets_them(store) -> None:
    """As a store written before summaries files: every chunk file is read; the next save that
    extends its chain and `verify` write the files."""
    blobs, longer = make_chain(toks(4)), make_chain(toks(6))
    sid = store.put_snapshot("old", FP, blobs)
    sums_path(store, blobs[-1].chain_hash).unlink()
    got, calls = reads(store, hashes_of(blobs))
    assert calls["get_range"] >= 4 and same(got, store.chunk_summaries(hashes_of(blobs), FP))
    store.put_snapshot("grown", FP, [*hashes_of(blobs), *longer[4:]])
    got, calls = reads(store, hashes_of(longer))
    assert calls == {"get_summaries": 1} and [g.tokens for g in got] == [b.tokens for b in longer]
    (missing,) = store.verify().summaries
    assert missing.snapshots == (sid,) and "file missing" in missing.reason
    assert sums_path(store, blobs[-1].chain_hash).is_file()


def test_rm_and_prune_take_the_file_with_the_last_snapshot_of_its_chain(store) -> None:
    blobs, other = make_chain(toks(3)), make_chain(toks(2, start=300))
    a, b = (store.put_snapshot(label, FP, blobs) for label in ("a", "b"))  # one chain, one file
    store.put_snapshot("other", FP, other)
    path = sums_path(store, blobs[-1].chain_hash)
    assert store.du().summaries_files == 2
    store.rm(a)
    assert path.is_file() and reads(store, hashes_of(blobs))[1] == {"get_summaries": 1}
    store.rm(b)
    assert not path.exists()
    assert store.prune(max_bytes=0).snapshots and not list(store.backend.list_summaries())
    usage = store.du()
    assert (usage.summaries_files, usage.summaries_bytes, usage.orphan_files) == (0, 0, 0)


def test_a_summaries_file_of_no_snapshot_is_an_orphan_that_prune_sweeps(store) -> None:
    """A save killed between its summaries file and its index commit."""
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    lost = make_chain(toks(3, start=900))
    last = lost[-1].chain_hash
    store.backend.put_summaries(
        last, store.writer.summaries_parts(FP, last, [(b.tokens, b.summary) for b in lost])
    )
    usage, report = store.du(), store.verify()
    assert usage.orphan_files == 1 and report.orphan_files == 1 and usage.summaries_files == 1
    assert store.prune().swept_files == 1
    assert not sums_path(store, last).exists() and [s.id for s in store.list_snapshots()] == [sid]


def test_an_index_rebuilt_from_the_chunk_files_finds_the_files_again(tmp_path) -> None:
    root = tmp_path / "store"
    a, b = make_chain(toks(3)), make_chain(toks(2, start=500))
    with SnapshotStore(root, workers=2) as st:
        for label, blobs in (("a", a), ("b", b), ("a-prefix", a[:2])):
            st.put_snapshot(label, FP, blobs)
    for suffix in ("-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.warns(UserWarning, match="rebuilt"):
        st = SnapshotStore(root, workers=2, backend=Counting(root))
    with st:
        for blobs in (a, a[:2], b):  # a's prefix is read from a's file: its own is an orphan now
            got, calls = reads(st, hashes_of(blobs))
            assert calls == {"get_summaries": 1} and [g.tokens for g in got] == [x.tokens for x in blobs]
        assert st.du().orphan_files == 1 and st.prune().swept_files == 1
        assert st.verify().summaries == []


def test_a_lazy_restore_and_a_turn_2_read_the_snapshots_file(lm, tmp_path) -> None:  # noqa: F811
    """Through the prefix cache on the tiny model: the document again, a turn 2 that extends it, and
    a prompt that shares part of it each read their summaries in one read of the snapshot's file,
    and restore what a store without summaries files restores."""
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2, backend=Counting(root)) as st:
        snapshots = KVSnapshots(st, MODEL_FP)
        doc = prompt(300, 2)
        hs = st.get_snapshot(saved(lm, snapshots, doc)).chunk_hashes
        prompts = {"again": doc, "turn 2": doc + prompt(40, 3), "shared part": doc[:200] + prompt(40, 4)}
        restored = {}
        for name, ids in prompts.items():
            st.backend.calls.clear()
            restored[name] = _lazy(lm, snapshots, ids)
            assert st.backend.calls["get_summaries"] == 1 and st.backend.calls["get_range"] == 0, name
        assert restored["turn 2"][0] == doc[: len(hs) * 16] and len(restored["shared part"][0]) == 192
        sums_path(st, hs[-1]).unlink()
        for name, ids in prompts.items():
            st.backend.calls.clear()
            tokens, rows = _lazy(lm, snapshots, ids)
            assert st.backend.calls["get_range"] >= len(tokens) // 16, name
            assert tokens == restored[name][0] and torch.equal(bits(rows), bits(restored[name][1]))


def _lazy(lm, snapshots: KVSnapshots, ids: list[int]) -> tuple[list[int], torch.Tensor]:  # noqa: F811
    """The tokens and summaries a lazy restore of ids' stored prefix adopts."""
    cache = PrefixCache(tiny_engine(lm), snapshots, lazy=True)
    try:
        taken = cache.take(ids)
        kv = taken.kv
        assert taken.source == "lazy", taken
        n = kv.seq.n_sealed
        return list(kv.seq.tokens), kv.seq.summaries[:n].cpu().clone()
    finally:
        cache.drop(kv)
        cache.close()


# the shared tier


def test_the_shared_tier_keeps_and_removes_summaries_files(redis_server, tmp_path) -> None:
    blobs = make_chain(toks(5))
    hs = hashes_of(blobs)
    key = f"kvflash:sums:{hs[-1]}"
    r = redis_server.client()
    with RedisStore(redis_server.url) as st:
        sid = st.put_snapshot("doc", FP, blobs)
        assert r.ttl(key) == -1  # committed with its snapshot
        want = st.chunk_summaries(hs, FP)
        r.delete(key)  # evicted
        assert same(st.read_summaries(hs, FP), want)
        (found,) = st.verify().summaries
        assert found.reason.endswith("written again from the chunk files") and r.ttl(key) == -1
        for h in hs:  # every chunk blob's summary section damaged: only the summaries file serves
            r.setrange(f"kvflash:blob:{h}", 208 + 4 * C + 1, b"\xff")
        assert same(st.read_summaries(hs, FP), want)
        r.setrange(key, r.strlen(key) - 3, b"\xff")
        (found,) = st.verify().summaries
        assert "checksum mismatch" in found.reason and "not written again" in found.reason
        lost = make_chain(toks(2, start=900))  # a save that never committed: its file expires
        last = lost[-1].chain_hash
        st.backend.put_summaries(
            last, st.writer.summaries_parts(FP, last, [(b.tokens, b.summary) for b in lost])
        )
        assert 0 < r.ttl(f"kvflash:sums:{last}") <= 3600
        assert st.du().orphan_files == 1 and st.prune().swept_files == 0 and r.exists(f"kvflash:sums:{last}")
        st.rm(sid)
        assert not r.exists(key)


def test_the_tiers_copy_the_file_and_another_server_reads_it(redis_server, tmp_path) -> None:
    blobs = make_chain(toks(5))
    hs = hashes_of(blobs)
    with TieredStore(SnapshotStore(tmp_path / "a"), RedisStore(redis_server.url)) as tiers:
        tiers.put_snapshot("doc", FP, blobs)
    r = redis_server.client()
    assert r.ttl(f"kvflash:sums:{hs[-1]}") == -1  # written back with its snapshot
    for h in hs:  # the shared blobs' summary sections damaged: only the file serves
        r.setrange(f"kvflash:blob:{h}", 208 + 4 * C + 1, b"\xff")
    with TieredStore(SnapshotStore(tmp_path / "b"), RedisStore(redis_server.url)) as other:
        got = other.read_summaries(hs, FP, torch.empty((5, *blobs[0].summary.shape)))
        assert [g.tokens for g in got] == [b.tokens for b in blobs]
        assert all(torch.equal(g.summary, b.summary) for g, b in zip(got, blobs, strict=True))
