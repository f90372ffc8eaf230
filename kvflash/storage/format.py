"""The chunk file (docs/FORMAT.md): a fixed little-endian header, token ids, then the payload (and, in
files before version 3, a summary section between them).

`struct` and `numpy.frombuffer` only: a file from anywhere is data, never code. Every length in a
header is checked against the shape and the file size before anything is allocated for it.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from kvflash.storage import codec
from kvflash.storage.chunk import ChunkBlob, chain_digest, token_bytes
from kvflash.storage.codec import Codec
from kvflash.storage.errors import (
    ChunkCorrupt,
    ChunkMismatch,
    ForeignFingerprint,
    InvalidName,
    SizeMismatch,
    UnsupportedVersion,
)
from kvflash.storage.key_means import key_means, residual, summary_of
from kvflash.storage.names import MAX_FINGERPRINT, check_fingerprint

MAGIC = b"KVFLCHNK"
VERSION = 3
"""Version 2 adds KV dtype 4 (fp8 e4m3, stored in the fp8 codec as held); version 3 the
lossless-bf16 codec and the summary kept as a residual in the payload (kvflash/storage/key_means.py)
instead of a section of its own. Files of versions 1 and 2 read as before."""
VERSIONS = (1, 2, 3)

_PREFIX = struct.Struct("<8sH")
_HEADER = struct.Struct(f"<8sHBB{MAX_FINGERPRINT}sQ32s32s5IIIQQIII")
_HEADER_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _HEADER_CRC.size

MAX_DIMS = (4096, 2, 4096, 1 << 16, 1 << 14)
"""Per-axis caps of [L, 2, Hkv, C, D]: far above any real model, far below an overflow."""
MAX_SUMMARY_BLOCKS = MAX_DIMS[3]
"""Cap of B, the summary's blocks per chunk (it also divides C, so B <= C)."""
MAX_RAW_BYTES = 1 << 30
MAX_CHUNK_INDEX = (1 << 40) - 1
"""Cap of a chunk's position in its chain (a u64 field): past any context, inside SQLite's signed
64-bit integers, which the index stores it in."""


def stored_bound(raw_len: int) -> int:
    """Above zstd's compress bound for raw_len bytes."""
    return raw_len + (raw_len >> 7) + 4096


MAX_FILE_BYTES = HEADER_SIZE + 4 * MAX_DIMS[3] + 2 * MAX_RAW_BYTES + stored_bound(MAX_RAW_BYTES)
"""No valid chunk file is larger (B <= C keeps the summary `4·L·Hkv·B·D` bytes at most twice the raw
size); backends refuse more."""


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    codec: Codec
    dtype: torch.dtype
    fingerprint: str
    index: int
    chain_hash: str
    parent_hash: str
    shape: tuple[int, int, int, int, int]
    n_tokens: int
    summary_blocks: int
    """B: the summary holds the mean key of each of B equal runs of the chunk's tokens."""
    raw_len: int
    stored_len: int
    raw_crc: int
    stored_crc: int
    meta_crc: int
    """crc32 of the token ids then the summary (version 3: the summary the payload gives back)."""

    @property
    def tokens_len(self) -> int:
        return 4 * self.n_tokens

    @property
    def summary_in_payload(self) -> bool:
        """Version 3: the payload's raw bytes end with the summary's residual (no summary section)."""
        return self.version >= 3

    @property
    def meta_len(self) -> int:
        """Bytes between the header and the payload: token ids, and the summary before version 3."""
        return self.tokens_len + (0 if self.summary_in_payload else self.summary_len)

    @property
    def extra_len(self) -> int:
        """Raw bytes of the payload past the codec's: the summary's residual in version 3."""
        return self.summary_len if self.summary_in_payload else 0

    @property
    def summary_shape(self) -> tuple[int, int, int, int]:
        L, _, H, _, D = self.shape
        return (L, H, self.summary_blocks, D)

    @property
    def summary_len(self) -> int:
        return 4 * math.prod(self.summary_shape)

    @property
    def file_len(self) -> int:
        return HEADER_SIZE + self.meta_len + self.stored_len

    @property
    def kv_bytes(self) -> int:
        """Uncompressed KV size: what a compression ratio is measured against."""
        return math.prod(self.shape) * self.dtype.itemsize


def encode_chunk(blob: ChunkBlob, codec_id: Codec, level: int) -> tuple[bytes, bytes, ChunkHeader]:
    """(header + tokens, payload, header): two buffers so the payload is never copied. The KV is
    written in `codec.stored_as(codec_id, dtype)`; the summary rides in the payload as its residual
    against the keys' block means."""
    kv = blob.kv.detach().cpu().contiguous()
    summary = blob.summary.detach().cpu().contiguous().numpy().astype("<f4")
    tokens = token_bytes(blob.tokens)
    exact = codec.exact(codec.stored_as(codec_id, kv.dtype), kv.dtype)
    means = key_means(kv, summary.shape[2], exact)
    enc = codec.encode(kv, codec_id, level, residual(summary, means))
    h = ChunkHeader(
        version=VERSION,
        codec=enc.codec,
        dtype=kv.dtype,
        fingerprint=blob.fingerprint,
        index=blob.index,
        chain_hash=blob.chain_hash,
        parent_hash=blob.parent_hash,
        shape=codec.kv_shape(kv),
        n_tokens=len(blob.tokens),
        summary_blocks=summary.shape[2],
        raw_len=enc.raw_len,
        stored_len=len(enc.payload),
        raw_crc=enc.raw_crc,
        stored_crc=zlib.crc32(enc.payload),
        meta_crc=zlib.crc32(summary, zlib.crc32(tokens)),
    )
    return pack_header(h) + tokens, enc.payload, h


def pack_header(h: ChunkHeader) -> bytes:
    body = _HEADER.pack(
        MAGIC,
        h.version,
        int(h.codec),
        codec.DTYPE_CODES[h.dtype],
        h.fingerprint.encode("ascii"),
        h.index,
        bytes.fromhex(h.chain_hash),
        bytes.fromhex(h.parent_hash),
        *h.shape,
        h.n_tokens,
        h.summary_blocks,
        h.raw_len,
        h.stored_len,
        h.raw_crc,
        h.stored_crc,
        h.meta_crc,
    )
    return with_crc(body)


def with_crc(body: bytes) -> bytes:
    """A header's fields followed by their crc32, as `checked_fields` reads them."""
    return body + _HEADER_CRC.pack(zlib.crc32(body))


def parse_header(buf: bytes | memoryview, file_len: int, chunk_hash: str) -> ChunkHeader:
    """Reads and validates a header against the file length; allocates nothing sized by the header."""
    f = checked_fields(buf, _HEADER, MAGIC, VERSIONS, "chunk file", chunk_hash)
    codec_id, dtype_code = f[2], f[3]
    if codec_id not in Codec._value2member_map_ or dtype_code not in codec.DTYPES_BY_CODE:
        raise ChunkCorrupt(chunk_hash, f"unknown codec {codec_id} or dtype {dtype_code}")
    dtype = codec.DTYPES_BY_CODE[dtype_code]
    too_new = (dtype == codec.FP8 and f[1] < 2) or (codec_id == Codec.LOSSLESS_BF16 and f[1] < 3)
    if not codec.fits(Codec(codec_id), dtype) or too_new:
        raise ChunkCorrupt(chunk_hash, f"codec {codec_id} with dtype {dtype_code} in a version {f[1]} file")
    h = ChunkHeader(
        version=f[1],
        codec=Codec(codec_id),
        dtype=dtype,
        fingerprint=fingerprint_field(f[4], chunk_hash),
        index=f[5],
        chain_hash=f[6].hex(),
        parent_hash=f[7].hex(),
        shape=tuple(f[8:13]),
        n_tokens=f[13],
        summary_blocks=f[14],
        raw_len=f[15],
        stored_len=f[16],
        raw_crc=f[17],
        stored_crc=f[18],
        meta_crc=f[19],
    )
    _check_sizes(h, file_len, chunk_hash)
    return h


def checked_fields(
    buf: bytes | memoryview,
    fields: struct.Struct,
    magic: bytes,
    versions: tuple[int, ...],
    what: str,
    chunk_hash: str,
) -> tuple:
    """The fields of a header laid out as `fields` (magic and version first) and followed by the
    crc32 of its bytes, checked in that order: magic, version (one of `versions`), length, checksum."""
    if len(buf) < _PREFIX.size:
        raise ChunkCorrupt(chunk_hash, f"truncated: {len(buf)} bytes")
    found, v = _PREFIX.unpack_from(buf)
    if found != magic:
        raise ChunkCorrupt(chunk_hash, f"not a kvflash {what} (bad magic)")
    if v not in versions:
        known = ", ".join(map(str, versions))
        raise UnsupportedVersion(chunk_hash, f"{what} format version {v}; this kvflash reads {known}")
    size = fields.size + _HEADER_CRC.size
    if len(buf) < size:
        raise ChunkCorrupt(chunk_hash, f"truncated header: {len(buf)} of {size} bytes")
    (crc,) = _HEADER_CRC.unpack_from(buf, fields.size)
    if zlib.crc32(buf[: fields.size]) != crc:
        raise ChunkCorrupt(chunk_hash, "header checksum mismatch")
    return fields.unpack_from(buf)


def fingerprint_field(raw: bytes, chunk_hash: str) -> str:
    """A header's NUL-padded fingerprint field, which must be a well-formed fingerprint."""
    try:
        return check_fingerprint(raw.rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, InvalidName):
        raise ChunkCorrupt(chunk_hash, "malformed fingerprint field") from None


def _check_sizes(h: ChunkHeader, file_len: int, chunk_hash: str) -> None:
    if h.index > MAX_CHUNK_INDEX:
        raise SizeMismatch(chunk_hash, f"implausible chunk index {h.index}")
    if any(not 1 <= d <= cap for d, cap in zip(h.shape, MAX_DIMS, strict=True)) or h.shape[1] != 2:
        raise SizeMismatch(chunk_hash, f"implausible shape {list(h.shape)}")
    if h.n_tokens != h.shape[3]:
        raise SizeMismatch(chunk_hash, f"{h.n_tokens} tokens for a {h.shape[3]}-token chunk")
    b = h.summary_blocks
    if not 1 <= b <= MAX_SUMMARY_BLOCKS or h.shape[3] % b:
        raise SizeMismatch(chunk_hash, f"{b} summary blocks for a {h.shape[3]}-token chunk")
    least, most = (n + h.extra_len for n in codec.raw_bounds(h.codec, h.dtype, h.shape))
    if not least <= h.raw_len <= most or h.raw_len > MAX_RAW_BYTES:
        raise SizeMismatch(chunk_hash, f"raw length {h.raw_len}, shape implies {least}..{most}")
    if h.stored_len > stored_bound(h.raw_len):
        raise SizeMismatch(chunk_hash, f"stored length {h.stored_len} exceeds any zstd output of the raw")
    if h.file_len != file_len:
        raise SizeMismatch(chunk_hash, f"header implies {h.file_len} bytes, the file has {file_len}")


def check_identity(
    h: ChunkHeader,
    chunk_hash: str,
    expect_fingerprint: str,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
) -> None:
    """The file is the chunk it is named after, made under the expected model, of the expected layout."""
    if h.fingerprint != expect_fingerprint:
        raise ForeignFingerprint(chunk_hash, f"made under {h.fingerprint}, expected {expect_fingerprint}")
    if h.chain_hash != chunk_hash:
        raise ChunkCorrupt(chunk_hash, f"file holds chunk {h.chain_hash[:16]}")
    if expect_shape is not None and tuple(expect_shape) != h.shape:
        raise ChunkMismatch(chunk_hash, f"shape {list(h.shape)}, expected {list(expect_shape)}")
    if expect_dtype is not None and expect_dtype != h.dtype:
        raise ChunkMismatch(chunk_hash, f"dtype {h.dtype}, expected {expect_dtype}")


def decode_meta(
    h: ChunkHeader,
    meta: bytes | memoryview,
    chunk_hash: str,
    out: torch.Tensor | None = None,
    with_summary: bool = True,
) -> tuple[list[int], torch.Tensor | None]:
    """Token ids, checked by the chain hash, and the summary where the file has a section for it
    (before version 3; checked by the meta crc, and put into `out`, fp32 CPU of the header's summary
    shape, when given). A version 3 file's summary comes with its payload: None. None too with
    `with_summary=False`, the section still checked by the meta crc."""
    if len(meta) != h.meta_len:
        raise ChunkCorrupt(chunk_hash, "truncated token/summary sections")
    if not h.summary_in_payload and zlib.crc32(meta) != h.meta_crc:
        raise ChunkCorrupt(chunk_hash, "token/summary checksum mismatch")
    view = memoryview(meta)
    if chain_digest(bytes.fromhex(h.parent_hash), h.fingerprint, view[: h.tokens_len]) != h.chain_hash:
        raise ChunkCorrupt(chunk_hash, "chain hash does not match parent, fingerprint and tokens")
    tokens = np.frombuffer(view, dtype="<i4", count=h.n_tokens).tolist()
    if min(tokens) < 0:  # on a list of a chunk's tokens, cheaper than a numpy reduction
        raise ChunkCorrupt(chunk_hash, "negative token id")
    if out is not None and tuple(out.shape) != h.summary_shape:
        raise ChunkMismatch(chunk_hash, f"summary shape {list(h.summary_shape)}, expected {list(out.shape)}")
    if h.summary_in_payload or not with_summary:
        return tokens, None
    summary = np.frombuffer(view, dtype="<f4", offset=h.tokens_len).reshape(h.summary_shape)
    if out is None:
        return tokens, torch.from_numpy(summary.copy())
    np.copyto(out.numpy(), summary)
    return tokens, out


def _payload_summary(
    h: ChunkHeader, kv: torch.Tensor, extra: bytearray, tokens: memoryview, chunk_hash: str
) -> torch.Tensor:
    """A version 3 file's summary: its residual (the payload's last raw bytes) on the decoded keys'
    block means, checked by the meta crc."""
    summary = summary_of(extra, key_means(kv, h.summary_blocks, codec.exact(h.codec, h.dtype)))
    if zlib.crc32(summary, zlib.crc32(tokens)) != h.meta_crc:
        raise ChunkCorrupt(chunk_hash, "token/summary checksum mismatch")
    return torch.from_numpy(summary)


def check_file(buf: bytes | memoryview, chunk_hash: str) -> ChunkHeader:
    """A whole chunk file's header, sections, chain hash and payload checksum, without decoding its
    KV: what a copy of the file from one store to another checks (a version 3 summary, in the
    payload, is checked by the payload's crc here and by the meta crc where it is decoded)."""
    h = parse_header(buf, len(buf), chunk_hash)
    if h.chain_hash != chunk_hash:
        raise ChunkCorrupt(chunk_hash, f"file holds chunk {h.chain_hash[:16]}")
    view = memoryview(buf)
    meta_end = HEADER_SIZE + h.meta_len
    decode_meta(h, view[HEADER_SIZE:meta_end], chunk_hash)
    if zlib.crc32(view[meta_end:]) != h.stored_crc:
        raise ChunkCorrupt(chunk_hash, "payload checksum mismatch")
    return h


def decode_chunk(
    buf: bytes | memoryview,
    chunk_hash: str,
    expect_fingerprint: str,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    stored_crc: bool = True,
    with_summary: bool = True,
) -> ChunkBlob:
    """A whole chunk file -> ChunkBlob, after checking every checksum and the chain hash. The KV is
    decoded into `out` when given (which then sets the expected dtype, and shape: `codec.kv_shape`).

    `stored_crc=False` (restores) skips the crc32 over the stored payload: damage there then fails
    decompression or the raw crc (`codec.decode` checks it always), so the chunk is still refused,
    for one pass over the payload less. `verify` checks both.

    `with_summary=False` (restores, which take summaries from the summaries file) leaves the blob's
    summary None. A version 3 file's summary is then not rebuilt from the key means, so its meta crc
    (token ids, then that summary) goes unchecked; safe, since what it covers is checked otherwise:
    the token ids against the chain hash, the KV and residual the summary is rebuilt from by the
    raw crc. `verify` rebuilds the summary and checks it."""
    if out is not None:
        expect_shape, expect_dtype = codec.kv_shape(out), out.dtype
    h = parse_header(buf, len(buf), chunk_hash)
    check_identity(h, chunk_hash, expect_fingerprint, expect_shape, expect_dtype)
    view = memoryview(buf)
    meta_end = HEADER_SIZE + h.meta_len
    tokens, summary = decode_meta(h, view[HEADER_SIZE:meta_end], chunk_hash, with_summary=with_summary)
    payload = view[meta_end:]
    if stored_crc and zlib.crc32(payload) != h.stored_crc:
        raise ChunkCorrupt(chunk_hash, "payload checksum mismatch")
    extra = bytearray(h.extra_len) if h.summary_in_payload else None
    rebuild = with_summary and h.summary_in_payload
    try:  # a summary to rebuild is checked after the decode: `out` is written only once it passes
        kv = codec.decode(
            payload, h.codec, h.dtype, h.shape, h.raw_len, h.raw_crc, None if rebuild else out, extra
        )
    except ValueError as e:
        raise ChunkCorrupt(chunk_hash, f"payload: {e}") from None
    if rebuild:
        summary = _payload_summary(h, kv, extra, view[HEADER_SIZE:meta_end], chunk_hash)
        if out is not None:
            kv = out.copy_(kv)
    return ChunkBlob(h.fingerprint, h.index, h.chain_hash, h.parent_hash, tokens, summary, kv)
