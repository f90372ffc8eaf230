"""Fuzzing the chunk-file parsers (kvflash/storage/format.py, kvflash/storage/codec.py): every mutation of a
valid file, each of whose bytes lies in a checksummed region, is refused with a ChunkError by `verify`'s
full check; a restore, which checks the decompressed bytes against the header's raw crc instead of the
stored bytes against theirs, refuses it or decodes exactly the original chunk (a flip of a frame-header
bit zstd ignores changes nothing it reads). The same for summaries files (kvflash/storage/summaries.py),
whose every byte is checked both by `verify`'s full check and by a restore's read of all its entries.
Nothing a file holds makes a parser crash, hang or allocate past a bound. Each property runs a few hundred
examples in `make test` and many thousands under `make test-reliability`."""

from __future__ import annotations

import tracemalloc
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflash.storage import ROOT_HASH, ChunkBlob, ChunkError
from kvflash.storage.chunk import token_bytes
from kvflash.storage.codec import Codec, decode
from kvflash.storage.format import HEADER_SIZE, decode_chunk, encode_chunk, parse_header
from kvflash.storage.summaries import (
    SUMMARIES_HEADER_SIZE,
    HeadRead,
    check_summaries_file,
    entry_crc,
    pack_head,
    parse_summaries_header,
    summary_frame,
)

FP = "fp-fuzz"
SHAPE = (2, 2, 2, 16, 8)
ALLOC_BOUND = 1 << 20
"""What refusing a file of ~2 KiB may allocate at most (a lying header would ask for gigabytes)."""
FAST = settings(max_examples=300, deadline=2000)
LONG = settings(max_examples=10_000, deadline=2000)


def _file(codec: Codec) -> tuple[bytes, str]:
    g = torch.Generator().manual_seed(7)
    kv = torch.randn(SHAPE, generator=g).to(torch.bfloat16)
    summary = kv[:, 0].float().reshape(2, 2, 4, 4, 8).mean(3)
    blob = ChunkBlob.build(FP, 0, ROOT_HASH, list(range(100, 116)), summary, kv)
    head, payload, _ = encode_chunk(blob, codec, 1)
    return head + payload, blob.chain_hash


def _summaries_file() -> tuple[bytes, list[str]]:
    """A summaries file of a three-chunk chain, and the chain."""
    g = torch.Generator().manual_seed(8)
    parent, entries, hashes = ROOT_HASH, [], []
    for i in range(3):
        summary = torch.randn((2, 2, 4, 8), generator=g)
        blob = ChunkBlob.build(FP, i, parent, list(range(16 * i, 16 * i + 16)), summary, torch.empty(0))
        entries.append((token_bytes(blob.tokens), summary))
        parent = blob.chain_hash
        hashes.append(parent)
    crcs = [entry_crc(t, s.numpy().tobytes()) for t, s in entries]
    frames = [summary_frame(s, 1) for _, s in entries]
    head = pack_head(FP, parent, 16, (2, 2, 4, 8), crcs, [len(f) for f in frames])
    return head + b"".join(t for t, _ in entries) + b"".join(frames), hashes


FILES = {c: _file(c) for c in (Codec.LOSSLESS, Codec.FP8)}  # bf16 KV: lossless-bf16 and fp8
SUMMARIES, CHAIN = _summaries_file()
ORIGINAL = {c: decode_chunk(data, h, FP) for c, (data, h) in FILES.items()}
CODECS = st.sampled_from(list(FILES))


def peak_bytes(fn: Callable[[], object], refused: type[BaseException] | tuple = ()) -> tuple[object, int]:
    """fn's result (None where it raised `refused`) and the most bytes it held allocated at once."""
    tracemalloc.start()
    try:
        out = fn()
    except refused:
        out = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out, peak


def _refused(data: bytes, h: str, stored_crc: bool, codec: Codec = Codec.LOSSLESS) -> None:
    blob, peak = peak_bytes(lambda: decode_chunk(data, h, FP, stored_crc=stored_crc), ChunkError)
    assert peak < ALLOC_BOUND + 4 * len(data), f"refusing a {len(data)}-byte file allocated {peak} bytes"
    if blob is not None:
        assert not stored_crc, "verify's full check accepted a mutated file"
        assert _same(blob, ORIGINAL[codec]), "a restore accepted a mutation that changed the chunk"


def _same(a: ChunkBlob, b: ChunkBlob) -> bool:
    """Bit-identical: tokens, position, parent, KV and summary."""
    bits = [
        (t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8))
        for t, u in ((a.kv, b.kv), (a.summary, b.summary))
    ]
    same = (a.tokens, a.index, a.parent_hash) == (b.tokens, b.index, b.parent_hash)
    return same and all(torch.equal(t, u) for t, u in bits)


@pytest.mark.parametrize("codec", list(FILES))
def test_the_valid_file_decodes(codec) -> None:
    data, h = FILES[codec]
    assert decode_chunk(data, h, FP).chain_hash == h


def single_bit_flips(codec, at, bit, restore) -> None:
    """Restores skip the stored crc where the zstd frame checks itself: refused all the same."""
    data, h = FILES[codec]
    buf = bytearray(data)
    buf[at % len(buf)] ^= 1 << bit
    _refused(bytes(buf), h, stored_crc=not restore, codec=codec)


def multi_byte_mutations(codec, edits, restore) -> None:
    data, h = FILES[codec]
    buf = bytearray(data)
    for at, xor in edits:
        buf[at % len(buf)] ^= xor
    if bytes(buf) != data:  # edits that cancel out leave the valid file
        _refused(bytes(buf), h, stored_crc=not restore, codec=codec)


def test_a_restore_refuses_a_frame_whose_damaged_block_sizes_hide_its_checksum() -> None:
    """Edits (found by `multi_byte_mutations`) after which zstd's stream reader yields all of the
    fp8 payload's raw bytes, wrong, and stops at the end of its input short of the frame's checksum:
    the header's raw crc refuses them."""
    data, h = FILES[Codec.FP8]
    buf = bytearray(data)
    for at, xor in [(1637, 196), (523, 15), (677, 140), (526, 109), (771, 229)]:
        buf[at] ^= xor
    with pytest.raises(ChunkError, match="raw checksum mismatch"):
        decode_chunk(bytes(buf), h, FP, stored_crc=False)


def truncations_and_extensions(codec, cut, tail) -> None:
    data, h = FILES[codec]
    mutated = data[: cut % len(data)] + tail
    if mutated != data:
        _refused(mutated, h, stored_crc=True, codec=codec)


def headers_of_noise(header, size) -> None:
    """Noise behind a valid magic and header checksum never allocates by its sizes (a consistent
    header of noise may pass parsing: the file-size and payload checks follow)."""
    data, h = FILES[Codec.LOSSLESS]
    forged = bytearray(data[:10]) + header[10 : HEADER_SIZE - 4]
    forged += zlib.crc32(forged).to_bytes(4, "little")
    assert peak_bytes(lambda: parse_header(bytes(forged), size, h), ChunkError)[1] < ALLOC_BOUND


def _summaries_refused(data: bytes) -> None:
    """By the full check and by a restore's read of every entry, within the allocation bound."""

    def both() -> None:
        with pytest.raises(ChunkError):
            check_summaries_file(data, CHAIN[-1], FP, CHAIN)
        with pytest.raises(ChunkError):
            read = HeadRead(CHAIN[-1], FP, CHAIN, None)
            for at, dest in read.plan(memoryview(data)[: read.head_len], len(data)):
                dest[:] = data[at : at + len(dest)]
            read.check_tokens()
            read.check_entries(0, len(CHAIN))

    peak = peak_bytes(both)[1]
    assert peak < ALLOC_BOUND + 4 * len(data), f"refusing a {len(data)}-byte file allocated {peak} bytes"


@pytest.mark.parametrize("at, xor", [(851, 0x04), (1326, 0x10)])
def test_a_summaries_frame_whose_ignored_header_bits_changed_is_refused(at: int, xor: int) -> None:
    """Edits (found by `summaries_mutations`) to a frame's header descriptor that zstd reads past:
    its content-checksum flag cleared (the checksum then goes unread), its unused bit set. The
    summaries decode the same, but the file is not what was written: both reads refuse it."""
    buf = bytearray(SUMMARIES)
    buf[at] ^= xor
    _summaries_refused(bytes(buf))


def test_the_valid_summaries_file_is_read() -> None:
    assert check_summaries_file(SUMMARIES, CHAIN[-1], FP, CHAIN).n_chunks == 3


def summaries_mutations(edits) -> None:
    buf = bytearray(SUMMARIES)
    for at, xor in edits:
        buf[at % len(buf)] ^= xor
    if bytes(buf) != SUMMARIES:
        _summaries_refused(bytes(buf))


def summaries_truncations_and_extensions(cut, tail) -> None:
    mutated = SUMMARIES[: cut % len(SUMMARIES)] + tail
    if mutated != SUMMARIES:
        _summaries_refused(mutated)


def summaries_headers_of_noise(header, size) -> None:
    forged = bytearray(SUMMARIES[:10]) + header[10 : SUMMARIES_HEADER_SIZE - 4]
    forged += zlib.crc32(forged).to_bytes(4, "little")
    assert (
        peak_bytes(lambda: parse_summaries_header(bytes(forged), size, CHAIN[-1]), ChunkError)[1]
        < ALLOC_BOUND
    )


def codec_payloads(payload, codec, shape, raw_len, crc) -> None:
    """Any payload under any claimed shape and length: a ValueError at most, within the bound."""
    shape = (shape[0], 2, *shape[2:])
    assert (
        peak_bytes(lambda: decode(payload, codec, torch.bfloat16, shape, raw_len, crc), ValueError)[1]
        < ALLOC_BOUND
    )


PROPERTIES = {
    single_bit_flips: dict(
        codec=CODECS, at=st.integers(0, 10**6), bit=st.integers(0, 7), restore=st.booleans()
    ),
    multi_byte_mutations: dict(
        codec=CODECS,
        edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=8),
        restore=st.booleans(),
    ),
    truncations_and_extensions: dict(codec=CODECS, cut=st.integers(0, 10**6), tail=st.binary(max_size=64)),
    headers_of_noise: dict(
        header=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE), size=st.integers(0, 1 << 40)
    ),
    summaries_mutations: dict(
        edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=8)
    ),
    summaries_truncations_and_extensions: dict(cut=st.integers(0, 10**6), tail=st.binary(max_size=64)),
    summaries_headers_of_noise: dict(
        header=st.binary(min_size=SUMMARIES_HEADER_SIZE, max_size=SUMMARIES_HEADER_SIZE),
        size=st.integers(0, 1 << 40),
    ),
    codec_payloads: dict(
        payload=st.binary(max_size=4096),
        codec=st.sampled_from(list(Codec)),
        shape=st.tuples(*(st.integers(1, 8) for _ in range(5))),
        raw_len=st.integers(0, 1 << 40),
        crc=st.integers(0, 2**32 - 1),
    ),
}
for _prop, _strategies in PROPERTIES.items():
    globals()[f"test_{_prop.__name__}"] = FAST(given(**_strategies)(_prop))
    globals()[f"test_{_prop.__name__}_at_length"] = pytest.mark.reliability(LONG(given(**_strategies)(_prop)))
