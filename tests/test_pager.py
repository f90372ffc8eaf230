"""Pager serialization: bit-exact round trips, chunk-aligned partial blobs, refusal of bad blobs."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.engine.host_tier import HostTier
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import ChunkPool
from kvflash.pager import HEADER, BlobError, deserialize, floor_to_chunk, serialize
from tests.tiny import tiny_config, tiny_model

FP = "f" * 32


def make_kv(cfg, n_slots=8, dtype=torch.float32, chunk_tokens=16) -> PagedKV:
    rc = ResidencyConfig(chunk_tokens=chunk_tokens, tail_chunks=2)
    pool = ChunkPool(cfg, n_slots, chunk_tokens, dtype, torch.device("cpu"))
    return PagedKV(pool, HostTier(pool, 1 << 26), rc, n_slots)


@pytest.fixture(scope="module")
def filled():
    """A sequence of 12 sealed chunks plus 5 tokens, 8 slots: some chunks live on the host tier."""
    cfg = tiny_config()
    model = tiny_model(cfg).to(torch.bfloat16)
    kv = make_kv(cfg, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (197,))
    for lo in range(0, 197, 32):
        piece = ids[lo : lo + 32]
        model(piece, torch.arange(lo, lo + piece.numel()), kv)
    assert kv.host.n_used > 0
    return cfg, kv


def _all_chunks(kv: PagedKV, n: int) -> list[torch.Tensor]:
    out = []
    for ch in kv.seq.chunks[:n]:
        out.append((kv.pool.kv[ch.gpu] if ch.gpu is not None else kv.host.view(ch.host)).clone())
    return out


def test_round_trip_is_bit_exact_and_rebuilds_summaries(filled) -> None:
    cfg, kv = filled
    blob = serialize(kv, FP)
    dst = make_kv(cfg, dtype=torch.bfloat16)
    assert deserialize(dst, blob, FP) == 12 * 16
    assert dst.seq.tokens == kv.seq.tokens[: 12 * 16]
    for a, b in zip(_all_chunks(kv, 12), _all_chunks(dst, 12), strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert torch.equal(dst.seq.summaries[:12], kv.seq.summaries[:12])
    assert all(ch.sealed for ch in dst.seq.chunks[:12])
    was_resident = {ch.index for ch in kv.seq.chunks[:12] if ch.gpu is not None}
    assert {ch.index for ch in dst.resident()} <= was_resident


def test_partial_serialization_at_chunk_boundary(filled) -> None:
    cfg, kv = filled
    assert floor_to_chunk(197, 16) == 192 and floor_to_chunk(32, 16) == 32
    blob = serialize(kv, FP, boundary=floor_to_chunk(100, 16))
    dst = make_kv(cfg, dtype=torch.bfloat16)
    assert deserialize(dst, blob, FP) == 96
    assert serialize(kv, FP, max_chunks=6) == blob
    with pytest.raises(KVFlashError, match="not a multiple"):
        serialize(kv, FP, boundary=100)


def _rewrite_header(blob: bytes, **changes) -> bytes:
    names = ["magic", "version", "fp", "c", "dtype", "layers", "heads", "dim", "n"]
    fields = dict(zip(names, HEADER.unpack_from(blob, 0), strict=True)) | changes
    head = HEADER.pack(*fields.values())
    return head + struct.pack("<I", zlib.crc32(head)) + blob[HEADER.size + 4 :]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:-7], "does not match"),
        (lambda b: b[:10], "shorter than its header"),
        (lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 1]) + b[len(b) // 2 + 1 :], "corrupt"),
        (lambda b: b[:3] + b"X" + b[4:], "bad magic"),
        (lambda b: _rewrite_header(b, fp=b"e" * 32), "fingerprint"),
        (lambda b: _rewrite_header(b, c=32), "chunk_tokens"),
        (lambda b: _rewrite_header(b, dtype=0), "dtype"),
        (lambda b: _rewrite_header(b, heads=7), "shape"),
        (lambda b: _rewrite_header(b, version=9), "version"),
        (lambda b: _rewrite_header(b, n=2**31), "does not match"),
        (lambda b: b[:20] + bytes([b[20] ^ 4]) + b[21:], "header checksum"),
    ],
)
def test_bad_blobs_are_refused_before_any_write(filled, mutate, message) -> None:
    cfg, kv = filled
    bad = mutate(serialize(kv, FP))
    dst = make_kv(cfg, dtype=torch.bfloat16)
    dst.pool.kv.fill_(7.0)
    before = dst.pool.kv.clone()
    with pytest.raises(BlobError, match=message):
        deserialize(dst, bad, FP)
    assert torch.equal(dst.pool.kv, before)
    assert len(dst.seq) == 0 and dst.pool.n_free == dst.pool.n_slots and dst.host.n_used == 0


def test_restored_sequence_continues_like_the_original() -> None:
    cfg = tiny_config()
    model = tiny_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (100,))
    src = make_kv(cfg, n_slots=16)
    model(ids[:96], torch.arange(96), src)
    dst = make_kv(cfg, n_slots=16)
    deserialize(dst, serialize(src, FP), FP)
    a = model(ids[96:], torch.arange(96, 100), src)
    b = model(ids[96:], torch.arange(96, 100), dst)
    assert torch.equal(a, b)
