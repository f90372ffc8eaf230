"""The summaries file of a snapshot (docs/FORMAT.md): the token ids and key summaries of every chunk
of its chain, in chain order, so that a lazy restore reads them in one read, not one per chunk file.

It is content-addressed by the chain's last hash, as a chunk file is by its own: that hash commits
to the fingerprint and every token of the chain, so the name says which chain the file holds and
nothing else. Snapshots of one chain share one file (a session's newer snapshot often has the chain
of the one it replaces), and the file needs no index row: the snapshots' member lists say which
files are live (a removal sweeps the others, as it sweeps orphan chunk files) and an index rebuilt
from the chunk files finds them again under the chains it recovers.

Any head of the file can be read alone: each entry carries the crc32 of its token ids and summary
(the chunk file's meta crc), and the token ids must give the chain hashes the reader asked for. So
a prompt that shares a prefix with a snapshot reads that prefix's entries only. Version 2 keeps each
summary as a zstd frame of its fp32 byte planes (about 1.6x smaller: a mean of bf16 keys leaves the
low mantissa bytes mostly zero) and a table of where each frame ends, right after the header, so a
reader of m entries finds theirs in its first read. `struct` and `numpy.frombuffer` only; every
length is checked against the file size before it is read.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvflash.storage import codec
from kvflash.storage.chunk import chain_digest
from kvflash.storage.errors import ChunkCorrupt, ChunkMismatch, ForeignFingerprint, SizeMismatch
from kvflash.storage.format import (
    MAX_DIMS,
    MAX_SUMMARY_BLOCKS,
    checked_fields,
    fingerprint_field,
    stored_bound,
    with_crc,
)
from kvflash.storage.names import MAX_FINGERPRINT

MAGIC = b"KVFLSUMS"
VERSION = 2
"""Version 2 compresses each summary (a zstd frame) and places the frames by a table of their ends;
version 1 files, summaries as they are, read as before."""
VERSIONS = (1, 2)

_HEADER = struct.Struct(f"<8sH2x{MAX_FINGERPRINT}s32s7I")
SUMMARIES_HEADER_SIZE = _HEADER.size + 4
ZSTD_MAX_RATIO = 1 << 15
"""No zstd frame decodes to more than this many times its own size (a block of 128 KiB is at least
4 bytes: an RLE block), so a version 2 file's frames bound the summaries its header may claim before
anything sized by that claim is allocated."""
NATIVE = sys.byteorder == "little"
"""Entries are read straight into the caller's fp32 tensor, whose bytes are the file's little-endian
floats on such a host; elsewhere summaries are read per chunk file (which converts)."""


@dataclass(frozen=True)
class SummariesHeader:
    version: int
    fingerprint: str
    last_hash: str
    n_chunks: int
    chunk_tokens: int
    summary_shape: tuple[int, int, int, int]
    """[L, Hkv, B, D] of every entry's summary."""
    table_crc: int
    """crc32 of the table of entry checksums (version 2: of the table of frame ends, then it)."""

    @property
    def tokens_len(self) -> int:
        """Bytes of one entry's token ids."""
        return 4 * self.chunk_tokens

    @property
    def summary_len(self) -> int:
        """Bytes of one entry's summary."""
        return 4 * math.prod(self.summary_shape)

    @property
    def compressed(self) -> bool:
        """Version 2: summaries as zstd frames placed by a table of their ends."""
        return self.version >= 2

    @property
    def tables_len(self) -> int:
        """Bytes of the table of frame ends (version 2) and the table of entry checksums."""
        return (12 if self.compressed else 4) * self.n_chunks

    @property
    def tokens_at(self) -> int:
        return SUMMARIES_HEADER_SIZE + self.tables_len

    @property
    def summaries_at(self) -> int:
        return self.tokens_at + self.n_chunks * self.tokens_len

    @property
    def file_len(self) -> int:
        """Version 1's size; version 2's is the last frame's end, at least `summaries_at`."""
        return self.summaries_at + (0 if self.compressed else self.n_chunks * self.summary_len)


def entry_crc(tokens: bytes | memoryview, summary: bytes | memoryview) -> int:
    """crc32 of an entry's token ids then its summary: the chunk file's meta crc of that chunk."""
    return zlib.crc32(summary, zlib.crc32(tokens))


def pack_head(
    fingerprint: str,
    last_hash: str,
    chunk_tokens: int,
    summary_shape: Sequence[int],
    crcs: Sequence[int],
    frame_lens: Sequence[int],
) -> bytes:
    """Header, table of frame ends and table of entry checksums: what precedes the entries' token
    ids and summary frames."""
    n = len(crcs)
    at = SUMMARIES_HEADER_SIZE + 12 * n + 4 * n * chunk_tokens
    ends = (at + np.cumsum(np.asarray(frame_lens, dtype=np.uint64))).astype("<u8").tobytes()
    table = ends + np.asarray(crcs, dtype="<u4").tobytes()
    body = _HEADER.pack(
        MAGIC,
        VERSION,
        fingerprint.encode("ascii"),
        bytes.fromhex(last_hash),
        n,
        chunk_tokens,
        *summary_shape,
        zlib.crc32(table),
    )
    return with_crc(body) + table


def summary_frame(summary: torch.Tensor, level: int) -> bytes:
    """A summary's zstd frame: its fp32 byte planes, most significant first, a block each."""
    planes = codec.split_planes(summary.detach().cpu().contiguous().to(torch.float32))
    size = len(planes) // 4
    return codec.compress_parts([planes[j * size : (j + 1) * size] for j in range(4)], level)[0]


def parse_summaries_header(buf: bytes | memoryview, file_len: int, name: str) -> SummariesHeader:
    """The header of the file named after chain `name`, checked against the file's size before any
    of the rest is read."""
    f = checked_fields(buf, _HEADER, MAGIC, VERSIONS, "summaries file", name)
    h = SummariesHeader(
        version=f[1],
        fingerprint=fingerprint_field(f[2], name),
        last_hash=f[3].hex(),
        n_chunks=f[4],
        chunk_tokens=f[5],
        summary_shape=tuple(f[6:10]),
        table_crc=f[10],
    )
    if h.last_hash != name:
        raise ChunkCorrupt(name, f"holds the chain ending at {h.last_hash[:16]}")
    L, H, B, D = h.summary_shape
    caps = ((L, MAX_DIMS[0]), (H, MAX_DIMS[2]), (D, MAX_DIMS[4]), (h.chunk_tokens, MAX_DIMS[3]))
    if h.n_chunks < 1 or any(not 1 <= x <= cap for x, cap in caps):
        shape = [h.n_chunks, h.chunk_tokens, *h.summary_shape]
        raise SizeMismatch(name, f"implausible shape {shape} (n, C, L, Hkv, B, D)")
    if not 1 <= B <= MAX_SUMMARY_BLOCKS or h.chunk_tokens % B:
        raise SizeMismatch(name, f"{B} summary blocks for a {h.chunk_tokens}-token chunk")
    most = h.file_len + (h.n_chunks * stored_bound(h.summary_len) if h.compressed else 0)
    if not h.file_len <= file_len <= most or (file_len != h.file_len and not h.compressed):
        raise SizeMismatch(name, f"header implies {h.file_len} bytes, the file has {file_len}")
    if h.compressed and h.n_chunks * h.summary_len > ZSTD_MAX_RATIO * (file_len - h.summaries_at):
        raise SizeMismatch(name, f"{h.n_chunks} summaries of {h.summary_len} bytes in {file_len} bytes")
    return h


def check_ends(h: SummariesHeader, ends: np.ndarray, file_len: int, name: str) -> None:
    """Frame ends of a version 2 file's first entries: in order, each frame no longer than zstd's
    bound for a summary, the last inside the file."""
    starts = np.concatenate([[h.summaries_at], ends[:-1]]).astype(np.uint64)
    if len(ends) and (
        (ends < starts).any() or (ends - starts > stored_bound(h.summary_len)).any() or ends[-1] > file_len
    ):
        raise ChunkCorrupt(name, "summary frames out of order or past the file")


def check_identity(
    h: SummariesHeader, name: str, fingerprint: str, n: int, shape: Sequence[int] | None = None
) -> None:
    """The file was made under the expected model, holds at least n entries, of the expected shape."""
    if h.fingerprint != fingerprint:
        raise ForeignFingerprint(name, f"made under {h.fingerprint}, expected {fingerprint}")
    if h.n_chunks < n:
        raise ChunkMismatch(name, f"{h.n_chunks} chunks, {n} asked for")
    if shape is not None and tuple(shape) != h.summary_shape:
        raise ChunkMismatch(name, f"summary shape {list(h.summary_shape)}, expected {list(shape)}")


def check_table(h: SummariesHeader, tables: bytes | memoryview, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(frame ends, entry checksums) once the tables' checksum matches (no frame ends in version 1)."""
    if zlib.crc32(tables) != h.table_crc:
        raise ChunkCorrupt(name, "checksum table mismatch")
    n = 8 * h.n_chunks if h.compressed else 0
    return np.frombuffer(tables, dtype="<u8", count=n // 8), np.frombuffer(tables, dtype="<u4", offset=n)


def check_chain(
    h: SummariesHeader, tokens: bytes | memoryview, hashes: Sequence[str], name: str
) -> list[list[int]]:
    """Token ids of the first len(hashes) entries, whose chain hashes must be `hashes`: the file
    holds exactly those chunks' ids, whatever it claims."""
    n, size = len(hashes), h.tokens_len
    view, parent = memoryview(tokens), bytes(32)
    for i, expected in enumerate(hashes):
        got = chain_digest(parent, h.fingerprint, view[i * size : (i + 1) * size])
        if got != expected:
            raise ChunkCorrupt(name, f"entry {i} is not chunk {expected[:16]}")
        parent = bytes.fromhex(got)
    ids = np.frombuffer(view, dtype="<i4", count=n * h.chunk_tokens)
    if n and ids.min() < 0:
        raise ChunkCorrupt(name, "negative token id")
    return ids.reshape(n, h.chunk_tokens).tolist()


def check_entries(
    h: SummariesHeader,
    table: np.ndarray,
    tokens: memoryview,
    summaries: memoryview,
    lo: int,
    hi: int,
    name: str,
) -> None:
    """Entries lo..hi-1 match their checksums (`tokens` and `summaries` hold entries 0.. as bytes)."""
    t, s = h.tokens_len, h.summary_len
    for i in range(lo, hi):
        if entry_crc(tokens[i * t : (i + 1) * t], summaries[i * s : (i + 1) * s]) != table[i]:
            raise ChunkCorrupt(name, f"entry {i} checksum mismatch")


def unpack_frames(
    h: SummariesHeader, ends: np.ndarray, frames: memoryview, rows: torch.Tensor, lo: int, hi: int, name: str
) -> None:
    """Version 2: entries lo..hi-1's frames (`frames` holds those of entries 0.. from `summaries_at`)
    decoded into rows[lo:hi]."""
    starts = np.concatenate([[h.summaries_at], ends[:-1]]) - h.summaries_at
    for i in range(lo, hi):
        frame = frames[int(starts[i]) : int(ends[i]) - h.summaries_at]
        try:
            codec.unpack_planes(frame, rows[i])
        except ValueError as e:
            raise ChunkCorrupt(name, f"entry {i}: {e}") from None


def check_summaries_file(
    buf: bytes | memoryview, name: str, fingerprint: str, hashes: Sequence[str]
) -> SummariesHeader:
    """A whole file, of exactly the chain `hashes` (what `verify` and a copy between tiers check)."""
    view = memoryview(buf)
    h = parse_summaries_header(view[:SUMMARIES_HEADER_SIZE], len(view), name)
    check_identity(h, name, fingerprint, len(hashes))
    if h.n_chunks != len(hashes):
        raise ChunkCorrupt(name, f"{h.n_chunks} chunks for a chain of {len(hashes)}")
    ends, table = check_table(h, view[SUMMARIES_HEADER_SIZE : h.tokens_at], name)
    tokens = view[h.tokens_at : h.summaries_at]
    check_chain(h, tokens, hashes, name)
    summaries = view[h.summaries_at :]
    if h.compressed:
        check_ends(h, ends, len(view), name)
        if ends[-1] != len(view):
            raise SizeMismatch(name, f"the frames end at {ends[-1]}, the file has {len(view)} bytes")
        rows = torch.empty((h.n_chunks, *h.summary_shape))
        unpack_frames(h, ends, summaries, rows, 0, h.n_chunks, name)
        summaries = byte_view(rows)
    check_entries(h, table, tokens, summaries, 0, h.n_chunks, name)
    return h


class HeadRead:
    """A read of the first len(hashes) entries of a summaries file: `plan` (a backend's ReadPlan)
    lays out the destinations from the head (`head_len`: the header and, in version 2, the first
    entries' frame ends), the summaries of version 1 going straight into `rows`; the checks then
    run on what was read. With `frames_only`, a version 2 file's frames are read as they are, for a
    copy (`frame_lens`), and nothing is decoded; a version 1 file, which has none, is refused."""

    def __init__(
        self,
        name: str,
        fingerprint: str,
        hashes: Sequence[str],
        out: torch.Tensor | None,
        frames_only: bool = False,
    ):
        self.name, self.fingerprint, self.hashes, self.out = name, fingerprint, hashes, out
        self.frames_only = frames_only
        self.head_len = SUMMARIES_HEADER_SIZE + 8 * len(hashes)

    def plan(self, head: memoryview, size: int) -> list[tuple[int, memoryview]]:
        n, out = len(self.hashes), self.out
        h = self.header = parse_summaries_header(head, size, self.name)
        check_identity(h, self.name, self.fingerprint, n, None if out is None else out.shape[1:])
        if self.frames_only and not h.compressed:
            raise ChunkMismatch(self.name, f"version {h.version}: no frames to copy")
        if not self.frames_only:
            self.rows = out if out is not None else torch.empty((n, *h.summary_shape))
        self.tables, self.tokens = bytearray(h.tables_len), bytearray(n * h.tokens_len)
        if h.compressed:
            if len(head) < self.head_len:
                raise ChunkCorrupt(self.name, f"truncated: {len(head)} bytes")
            self.head_ends = np.frombuffer(head, dtype="<u8", count=n, offset=SUMMARIES_HEADER_SIZE).copy()
            check_ends(h, self.head_ends, size, self.name)
            self.frames = bytearray(int(self.head_ends[-1]) - h.summaries_at)
        summaries = memoryview(self.frames) if h.compressed else byte_view(self.rows)
        return [
            (SUMMARIES_HEADER_SIZE, memoryview(self.tables)),
            (h.tokens_at, memoryview(self.tokens)),
            (h.summaries_at, summaries),
        ]

    def check_tokens(self) -> list[list[int]]:
        """The tables (whose frame ends must be those the plan placed) and the entries' token ids
        (as `check_chain`)."""
        self.ends, self.crcs = check_table(self.header, self.tables, self.name)
        if self.header.compressed and not np.array_equal(self.ends[: len(self.hashes)], self.head_ends):
            raise ChunkCorrupt(self.name, "the summaries file changed while it was read")
        return check_chain(self.header, self.tokens, self.hashes, self.name)

    def frame_lens(self) -> list[int]:
        """Each read entry's frame length, once `check_tokens` has passed."""
        n = len(self.hashes)
        return np.diff(self.ends[:n], prepend=np.uint64(self.header.summaries_at)).tolist()

    def check_entries(self, lo: int, hi: int) -> None:
        """Entries lo..hi-1: decoded (version 2) into their rows, then checked."""
        if self.header.compressed:
            unpack_frames(self.header, self.ends, memoryview(self.frames), self.rows, lo, hi, self.name)
        tokens, rows = memoryview(self.tokens), byte_view(self.rows)
        check_entries(self.header, self.crcs, tokens, rows, lo, hi, self.name)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, flat."""
    return memoryview(t.numpy()).cast("B")
