"""The disk snapshot store: codecs, format, content addressing, retention, concurrency, corruption,
disk full, names that try to escape the store, and the `snapshot` CLI."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest
import torch
import zstandard
from typer.testing import CliRunner

from kvflash import KVFlashError
from kvflash.cli import snapshot_cmd
from kvflash.storage import (
    ROOT_HASH,
    ChunkBlob,
    ChunkCorrupt,
    ChunkMismatch,
    ChunkMissing,
    DiskFull,
    ForeignFingerprint,
    InvalidChunk,
    InvalidName,
    SizeMismatch,
    SnapshotNotFound,
    SnapshotStore,
    StoreError,
    UnsupportedVersion,
    chain_hash,
    chain_hashes,
    codec,
    format,
)
from kvflash.storage.backend import LocalDirBackend
from kvflash.storage.codec import Codec

FP = "fp-test-0001"
L, H, C, D = 3, 2, 16, 8
B = 4
"""Summary blocks per chunk (the engine's default `summary_blocks`)."""
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def kv_for(tokens: list[int], dtype: torch.dtype = torch.bfloat16, shape=(L, 2, H, C, D)) -> torch.Tensor:
    """Deterministic KV per token run, so two processes saving the same tokens make the same chunk."""
    g = torch.Generator().manual_seed(zlib.crc32(str(tokens).encode()))
    scale = torch.logspace(-2, 1, shape[2]).reshape(1, 1, -1, 1, 1)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def block_summary(kv: torch.Tensor, blocks: int = B) -> torch.Tensor:
    """[L, Hkv, B, D] fp32: the mean key of each of `blocks` equal runs of tokens (as the engine seals)."""
    l, _, h, c, d = kv.shape
    return kv[:, 0].float().reshape(l, h, blocks, c // blocks, d).mean(3)


def make_chain(
    tokens: list[int], fp: str = FP, dtype: torch.dtype = torch.bfloat16, blocks: int = B
) -> list[ChunkBlob]:
    blobs, parent = [], ROOT_HASH
    for i in range(len(tokens) // C):
        run = tokens[i * C : (i + 1) * C]
        kv = kv_for(run, dtype)
        summary = block_summary(kv, blocks)
        blob = ChunkBlob.build(fp, i, parent, run, summary, kv)
        blobs.append(blob)
        parent = blob.chain_hash
    return blobs


def toks(n_chunks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_chunks * C))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def chunk_path(root: Path, h: str) -> Path:
    return root / "chunks" / h[:2] / f"{h}.kvc"


@pytest.fixture
def store(tmp_path):
    st = SnapshotStore(tmp_path / "store", workers=2)
    yield st
    st.close()


def forkserver() -> mp.context.BaseContext:
    """Children fork from a server that imported torch once: a fresh process costs milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvflash.storage"])
    return ctx


# codecs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [1, 3])
def test_lossless_codec_is_bit_exact(dtype, level) -> None:
    kv = kv_for(toks(1), dtype)
    flat = kv.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 0.0]).to(dtype)
    enc = codec.encode(kv, Codec.LOSSLESS, level)
    out = codec.decode(enc.payload, Codec.LOSSLESS, dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)
    assert out.dtype == dtype and torch.equal(bits(out), bits(kv))


def test_byte_planes_put_high_bytes_first() -> None:
    kv = torch.tensor([0x1234, 0x5678], dtype=torch.int16).view(torch.float16).reshape(1, 2, 1, 1, 1)
    assert codec._split_planes(kv) == bytes([0x12, 0x56, 0x34, 0x78])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_error_is_reported_and_bounded(dtype) -> None:
    kv = kv_for(toks(1), dtype)
    kv[1, 0, 1] = 0  # an all-zero block keeps scale 1 and decodes to zeros
    kv[0, 1, 0] *= 1000  # blocks of very different magnitude each get their own scale
    enc = codec.encode(kv, Codec.FP8)
    assert enc.raw_len == codec.raw_size(Codec.FP8, dtype, tuple(kv.shape))
    out = codec.decode(enc.payload, Codec.FP8, dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)
    err = codec.fp8_error(kv, out)
    assert err.shape == (L, 2, H)
    assert float(err.max()) <= 2**-4 + 2**-7, err  # e4m3 rounding plus the target dtype's
    assert float(err.max()) > 0 and torch.count_nonzero(out[1, 0, 1]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", [1 << 18, 5], ids=["one-step", "steps-inside-blocks"])
def test_fp8_decodes_each_byte_times_its_block_scale_rounded_once(dtype, step, monkeypatch) -> None:
    """The table decode gives what decoding element by element gives: the e4m3 value times its
    block's scale in fp32, rounded once to the dtype, for every byte and whatever the gather step."""
    monkeypatch.setattr(codec, "_GATHER_STEP", step)
    shape = (L, 2, H, 8, 32)
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(L, 2, H, generator=g) * 8
    scale[0, 0, 0] = 3e-39  # subnormal
    q = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    q.view(-1)[:256] = torch.arange(256).to(torch.uint8)
    raw = scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()
    payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    out = codec.decode(payload, Codec.FP8, dtype, shape, len(raw), zlib.crc32(raw))
    expected = (q.view(torch.float8_e4m3fn).float() * scale[..., None, None]).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_fp8_refuses_non_finite() -> None:
    kv = kv_for(toks(1))
    kv[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        codec.encode(kv, Codec.FP8)


def test_decode_refuses_a_frame_larger_than_the_header_says() -> None:
    kv = kv_for(toks(1))
    raw = codec.raw_size(Codec.LOSSLESS, kv.dtype, tuple(kv.shape))
    bigger = zstandard.ZstdCompressor().compress(bytes(raw * 64))
    with pytest.raises(ValueError, match="declares"):
        codec.decode(bigger, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), raw, 0)
    with pytest.raises(ValueError, match="does not fit"):
        codec.decode(bigger, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), raw * 64, 0)


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
    _flip(chunk_path(store.root, hs[2]), -10)
    dest = torch.zeros(L, 2, H, C, D, dtype=torch.bfloat16)
    with pytest.raises(ChunkCorrupt):
        store.read_chunk(hs[2], FP, out=dest)
    assert torch.count_nonzero(dest) == 0


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
    assert store._map(lambda i: i * i, 7) == [i * i for i in range(7)]
    assert store._map(lambda i: i, 0) == []
    calls = []

    def fn(i: int) -> int:
        calls.append(i)
        if i == 0:
            time.sleep(0.2)  # index 1 fails first
        if i in (0, 1):
            raise ChunkCorrupt(str(i) * 64, "bad")
        return i

    with pytest.raises(ChunkCorrupt) as e:
        store._map(fn, 100)
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
    # the chunk files' own sections (what a snapshot without a summaries file is read from)
    _flip(chunk_path(store.root, hs[0]), -10)  # payload: found when the KV itself is read
    assert store.chunk_summaries(hs[:1], FP)[0].tokens == blobs[0].tokens
    _flip(chunk_path(store.root, hs[1]), format.HEADER_SIZE + 4 * C + 3)  # summary
    with pytest.raises(ChunkCorrupt, match="summary"):
        store.chunk_summaries(hs, FP)
    with pytest.raises(ForeignFingerprint):
        store.read_summaries(hs, "fp-other")


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
    assert h.file_len == format.HEADER_SIZE + 4 * C + 4 * L * H * blocks * D + h.stored_len
    for got in (store.read_chunks_parallel(hs, FP), store.read_summaries(hs, FP)):
        assert all(torch.equal(g.summary, b.summary) for g, b in zip(got, blobs, strict=True))


def test_index_is_wal(store) -> None:
    assert store.index.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


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
    store.index.conn.execute("UPDATE snapshots SET last_used = last_used - ? WHERE id = ?", (seconds, sid))


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


# corruption


def _rewrite_header(path: Path, **fields) -> None:
    """Edits header fields and recomputes the header checksum: a file that lies consistently."""
    buf = bytearray(path.read_bytes())
    h = format.parse_header(bytes(buf), len(buf), "x" * 64)
    names = list(format.ChunkHeader.__dataclass_fields__)
    values = {n: getattr(h, n) for n in names} | fields
    buf[: format.HEADER_SIZE] = format.pack_header(format.ChunkHeader(**values))
    path.write_bytes(bytes(buf))


def _flip(path: Path, offset: int) -> None:
    buf = bytearray(path.read_bytes())
    buf[offset % len(buf)] ^= 0x40
    path.write_bytes(bytes(buf))


CORRUPTIONS = {
    # restores skip the stored crc32 where zstd checks the frame: the refusal says "payload: zstd ..."
    "payload byte": (lambda p: _flip(p, -10), ChunkCorrupt, "payload"),
    "payload byte, mid-frame": (lambda p: _flip(p, p.stat().st_size * 3 // 4), ChunkCorrupt, "payload"),
    "header byte": (lambda p: _flip(p, 40), ChunkCorrupt, "header checksum"),
    "token byte": (lambda p: _flip(p, format.HEADER_SIZE + 1), ChunkCorrupt, "token/summary"),
    "bad magic": (lambda p: _flip(p, 0), ChunkCorrupt, "magic"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), SizeMismatch, "the file has"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:50]), ChunkCorrupt, "truncated"),
    "empty file": (lambda p: p.write_bytes(b""), ChunkCorrupt, "truncated"),
    "missing file": (lambda p: p.unlink(), ChunkMissing, "missing"),
    "foreign fingerprint": (
        lambda p: _rewrite_header(p, fingerprint="fp-other"),
        ForeignFingerprint,
        "fp-other",
    ),
    "unknown version": (lambda p: _rewrite_header(p, version=99), UnsupportedVersion, "version 99"),
    "raw length 2**40": (lambda p: _rewrite_header(p, raw_len=1 << 40), SizeMismatch, "raw length"),
    "stored length 2**40": (lambda p: _rewrite_header(p, stored_len=1 << 40), SizeMismatch, "stored length"),
    "huge shape": (lambda p: _rewrite_header(p, shape=(1 << 31, 2, H, C, D)), SizeMismatch, "shape"),
    "zero summary blocks": (lambda p: _rewrite_header(p, summary_blocks=0), SizeMismatch, "0 summary blocks"),
    "summary blocks not dividing C": (
        lambda p: _rewrite_header(p, summary_blocks=3),
        SizeMismatch,
        "3 summary blocks",
    ),
    "summary blocks 2**31": (lambda p: _rewrite_header(p, summary_blocks=1 << 31), SizeMismatch, "summary"),
    "summary blocks that divide C, file does not agree": (
        lambda p: _rewrite_header(p, summary_blocks=C),
        SizeMismatch,
        "the file has",
    ),
    "shape and raw agree, file does not": (
        lambda p: _rewrite_header(p, shape=(L, 2, H, C, 4096), raw_len=L * 2 * H * C * 4096 * 2),
        SizeMismatch,
        "the file has",
    ),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_detected_and_refused(store, kind) -> None:
    damage, error, message = CORRUPTIONS[kind]
    blobs = make_chain(toks(3))
    sid = store.put_snapshot("s", FP, blobs)
    victim = blobs[1].chain_hash
    damage(chunk_path(store.root, victim))

    tracemalloc.start()
    with pytest.raises(error, match=message):
        store.read_chunk(victim, FP)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"refusing a bad chunk allocated {peak} bytes"

    report = store.verify(sid)
    assert not report.ok and [d.chunk_hash for d in report.damaged] == [victim]
    assert report.damaged[0].snapshots == (sid,)
    assert store.read_chunk(blobs[0].chain_hash, FP).index == 0  # its neighbours still serve
    if error is not UnsupportedVersion:
        assert store.find_longest_prefix(FP, [b.chain_hash for b in blobs]) == 1
        store.put_snapshot("again", FP, blobs)  # saving the same chunk again repairs it
        assert store.verify().ok


def test_index_rows_that_disagree_with_files_are_reported(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    store.index.conn.execute("UPDATE chunks SET refcount = 5 WHERE hash = ?", (blobs[0].chain_hash,))
    report = store.verify()
    assert any("refcount" in e and blobs[0].chain_hash in e for e in report.index_errors)
    assert store.verify(sid).index_errors == []  # refcounts are a whole-store check


# disk full


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a 2 MiB tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.decode().strip()}"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _noise_chain(n_chunks: int, start: int, shape=(2, 2, 4, 64, 64)) -> list[ChunkBlob]:
    """fp32 noise, 256 KiB a chunk: it barely compresses, so the bytes on disk are predictable."""
    blobs, parent = [], ROOT_HASH
    for i in range(n_chunks):
        run = list(range(start + i * shape[3], start + (i + 1) * shape[3]))
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(start + i))
        blob = ChunkBlob.build(FP, i, parent, run, torch.zeros(shape[0], shape[2], B, shape[4]), kv)
        blobs.append(blob)
        parent = blob.chain_hash
    return blobs


def test_disk_full_fails_cleanly_and_keeps_older_data(tiny_fs) -> None:
    with SnapshotStore(tiny_fs / "store", level=1, workers=2) as st:
        first = _noise_chain(2, start=0)
        sid = st.put_snapshot("first", FP, first)
        with pytest.raises(DiskFull, match="no space"):
            st.put_snapshot("too big", FP, _noise_chain(12, start=10_000))
        assert not list(tiny_fs.rglob("*.tmp"))
        assert [s.id for s in st.list_snapshots()] == [sid]
        assert sorted(st.backend.list_hashes()) == sorted(b.chain_hash for b in first)
        got = st.read_chunks_parallel(st.get_snapshot(sid).chunk_hashes, FP)
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(first, got, strict=True))
        assert st.verify().ok
        st.put_snapshot("work goes on", FP, _noise_chain(1, start=20_000))
        assert len(st.list_snapshots()) == 2 and st.verify().ok


# names from users


BAD_IDS = ["../x", "../../etc/passwd", "/etc/passwd", "abc\0def0123", "", "..", "ABCDEF012345", "a" * 13]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_ids_cannot_reach_outside_the_store(store, bad) -> None:
    for op in (store.get_snapshot, store.pin, store.unpin, store.rm, store.verify):
        with pytest.raises(InvalidName):
            op(bad)


@pytest.mark.parametrize("bad", ["../" * 10 + "etc/passwd", "/etc/passwd", "0" * 63 + "\0", "G" * 64])
def test_hashes_cannot_reach_outside_the_store(store, bad) -> None:
    with pytest.raises(InvalidName):
        store.read_chunk(bad, FP)
    with pytest.raises(InvalidName):
        store.find_longest_prefix(FP, [bad])
    with pytest.raises(InvalidName):
        with store.lease([bad]):
            pass
    with pytest.raises(InvalidName):
        store.put_snapshot("x", FP, [bad])


def test_labels_are_text_never_paths(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        for label in ("../../escape", "/etc/passwd", "a/b\\c", "..", "unicodé 文档"):
            sid = st.put_snapshot(label, FP, make_chain(toks(1)))
            assert st.get_snapshot(sid).label == label
        for label in ("nul\0byte", "new\nline", "x" * 201):
            with pytest.raises(InvalidName):
                st.put_snapshot(label, FP, make_chain(toks(1)))
        with pytest.raises(InvalidName):
            st.put_snapshot("ok", "../fp", make_chain(toks(1)))
    assert {p.name for p in tmp_path.iterdir()} == {"store"}
    assert {p.name for p in root.iterdir()} <= {
        "chunks",
        "lock",
        "index.sqlite",
        "index.sqlite-wal",
        "index.sqlite-shm",
        "reserve",
        "owners",
    }


# CLI


CLI = (
    "import typer; from kvflash.cli import snapshot_cmd as s; "
    "a = typer.Typer(); a.add_typer(s.app, name='snapshot'); a()"
)


def test_sizes_and_ages() -> None:
    assert snapshot_cmd.parse_size("10G") == 10 << 30
    assert snapshot_cmd.parse_size("500M") == 500 << 20
    assert snapshot_cmd.parse_size("1.5GiB") == 3 << 29
    assert snapshot_cmd.parse_size("4096") == 4096
    assert snapshot_cmd.parse_age("7d") == 7 * 86400 and snapshot_cmd.parse_age("12h") == 12 * 3600
    for bad in ("10X", "-1G", "", "1e9"):
        with pytest.raises(KVFlashError):
            snapshot_cmd.parse_size(bad)
    with pytest.raises(KVFlashError):
        snapshot_cmd.parse_age("7 days")


def test_cli_via_subprocess(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        good = st.put_snapshot("good", FP, make_chain(toks(2)))
        blobs = make_chain(toks(2, start=500))
        bad = st.put_snapshot("bad", FP, blobs)
    _flip(chunk_path(root, blobs[1].chain_hash), -3)
    runs = {"list": ["list"], "verify": ["verify", bad]}  # concurrent: each start imports torch
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-c", CLI, "snapshot", *args, "--store", str(root), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, args in runs.items()
    }
    out = {k: (p.communicate(timeout=60), p.returncode) for k, p in procs.items()}
    (listing, _), rc = out["list"]
    assert rc == 0 and {s["id"] for s in json.loads(listing)} == {good, bad}
    (verify, _), rc = out["verify"]
    assert rc == 1
    report = json.loads(verify)
    assert not report["ok"] and report["damaged"][0]["chunk_hash"] == blobs[1].chain_hash


def test_cli_commands(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        a = st.put_snapshot("a", FP, make_chain(toks(2)))
        b = st.put_snapshot("b", FP, make_chain(toks(3)))
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> dict | list:
        r = runner.invoke(snapshot_cmd.app, [*args, "--store", str(root), "--json"])
        assert r.exit_code == code, (args, r.output, r.exception)
        return json.loads(r.stdout) if code == 0 else {}

    facts = run("inspect", b)
    assert facts["n_chunks"] == 3 and facts["header"]["codec"] == "lossless"
    assert [c["refcount"] for c in facts["chunks"]] == [2, 2, 1]
    plan = run("prune", "--max-bytes", "10G", "--older-than", "7d", "--dry-run")
    assert plan["dry_run"] and plan["snapshots"] == []
    assert run("pin", a) == {"id": a, "pinned": True}
    assert run("verify", "--all")["ok"]
    assert run("prune", "--max-bytes", "0")["snapshots"] == [b]
    assert run("unpin", a)["pinned"] is False
    assert run("du")["snapshots"] == 1
    assert run("rm", a)["snapshots"] == [a]
    assert run("list") == []
    for bad in (["inspect", "../x"], ["verify"], ["rm", "0123456789ab"]):
        r = runner.invoke(snapshot_cmd.app, [*bad, "--store", str(root)])
        assert r.exit_code != 0
    r = runner.invoke(snapshot_cmd.app, ["list", "--store", str(tmp_path / "typo")])
    assert "no snapshot store" in str(r.exception)
    for human in (["list"], ["du"], ["verify", "--all"]):
        assert runner.invoke(snapshot_cmd.app, [*human, "--store", str(root)]).exit_code == 0


def test_inspect_decodes_text_with_a_given_tokenizer(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    facts = snapshot_cmd.inspect_snapshot(store, sid, decode_tokens=lambda ids: " ".join(map(str, ids)))
    assert facts["text"] == " ".join(map(str, toks(2)))


def test_frame_checksum_is_verified_and_old_frames_fall_back_to_the_raw_crc() -> None:
    """Frames carry zstd's content checksum, which replaces the raw crc32 on decode: a frame whose
    checksum disagrees with its content is refused even when the header's raw crc matches that
    content; a frame without one (older files) is still held to the raw crc."""
    kv = torch.randn(2, 2, 1, 4, 8).bfloat16()
    enc = codec.encode(kv, Codec.LOSSLESS)
    assert zstandard.get_frame_parameters(enc.payload).has_checksum
    other = codec._split_planes(kv + 1)
    forged = zstandard.ZstdCompressor(write_checksum=True).compress(other)
    bad = bytearray(forged)
    bad[-1] ^= 0xFF  # the frame's checksum no longer matches its content
    with pytest.raises(ValueError, match="zstd"):
        codec.decode(bytes(bad), Codec.LOSSLESS, kv.dtype, tuple(kv.shape), len(other), zlib.crc32(other))
    legacy = zstandard.ZstdCompressor(write_checksum=False).compress(other)
    with pytest.raises(ValueError, match="raw checksum"):
        codec.decode(legacy, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)
