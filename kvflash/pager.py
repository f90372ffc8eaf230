"""Pager serialization: a sequence's KV as logical-order chunk records aligned to chunk boundaries.

Layout (little-endian): a header, then one fixed-size record per chunk:
  header  magic "KVFPAGE1", version u16, fingerprint 32 bytes, chunk_tokens u32, dtype u8,
          n_layers u32, n_kv_heads u32, head_dim u32, n_chunks u32, header crc32 u32
  record  flags u8 (1 = was resident), score f32, token ids i32[C], summary f32[L, Hkv, B, D],
          KV bytes [L, 2, Hkv, C, D] in the KV dtype (fp8: as held, `pool.slot_shape`), record crc32 u32
Because records have a fixed size, the blob's length is checked against the header before anything
is allocated, and every checksum is checked before anything is written into the pool or host tier.
"""

from __future__ import annotations

import struct
import zlib

import torch

from kvflash import KVFlashError
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import chunk_bytes

MAGIC = b"KVFPAGE1"
VERSION = 1
HEADER = struct.Struct("<8sH32sIBIIII")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}
RECORD_HEAD = struct.Struct("<Bf")


class BlobError(KVFlashError):
    """A blob that cannot be restored: foreign, truncated, corrupt or inconsistent."""


def floor_to_chunk(n_tokens: int, chunk_tokens: int) -> int:
    """The largest chunk boundary at or below n_tokens."""
    return n_tokens - n_tokens % chunk_tokens


def _record_size(kv: PagedKV) -> int:
    cfg, c = kv.pool.cfg, kv.cfg.chunk_tokens
    summary = 4 * kv.summary_shape.numel()
    return RECORD_HEAD.size + 4 * c + summary + chunk_bytes(cfg, c, kv.pool.kv.dtype) + 4


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def serialize(
    kv: PagedKV, fingerprint: str, max_chunks: int | None = None, boundary: int | None = None
) -> bytes:
    """The first max_chunks sealed chunks (or those below a chunk-aligned token boundary)."""
    c = kv.cfg.chunk_tokens
    n = kv.seq.n_sealed
    if boundary is not None:
        if boundary % c:
            raise KVFlashError(f"boundary {boundary} is not a multiple of chunk_tokens {c}")
        if boundary > n * c:
            raise KVFlashError(f"boundary {boundary} is past the sealed prefix of {n * c} tokens")
        n = boundary // c
    if max_chunks is not None:
        n = min(n, max_chunks)
    cfg = kv.pool.cfg
    head = HEADER.pack(
        MAGIC,
        VERSION,
        fingerprint.encode().ljust(32, b"\0")[:32],
        c,
        DTYPE_CODES[kv.pool.kv.dtype],
        cfg.n_layers,
        cfg.n_kv_heads,
        cfg.head_dim,
        n,
    )
    parts = [head, struct.pack("<I", zlib.crc32(head))]
    for i in range(n):
        ch = kv.seq.chunks[i]
        rec = b"".join(
            (
                RECORD_HEAD.pack(ch.gpu is not None, ch.score),
                struct.pack(f"<{c}i", *kv.seq.chunk_tokens_of(i)),
                _raw(kv.seq.summaries[i].float()),
                _raw(kv.chunk_kv(i)),
            )
        )
        parts += [rec, struct.pack("<I", zlib.crc32(rec))]
    return b"".join(parts)


def _validate(kv: PagedKV, blob: bytes | memoryview, fingerprint: str) -> int:
    """Checks everything about the blob against this sequence's pool; returns the chunk count."""
    mv = memoryview(blob)
    hsize = HEADER.size + 4
    if len(mv) < hsize:
        raise BlobError(f"blob of {len(mv)} bytes is shorter than its header")
    fields = HEADER.unpack_from(mv, 0)
    (crc,) = struct.unpack_from("<I", mv, HEADER.size)
    if fields[0] != MAGIC:
        raise BlobError("not a kvflash pager blob (bad magic)")
    if zlib.crc32(mv[: HEADER.size]) != crc:
        raise BlobError("pager header checksum mismatch")
    _, version, fp, c, dtype, layers, heads, dim, n = fields
    cfg = kv.pool.cfg
    if version != VERSION:
        raise BlobError(f"pager format version {version} is not supported (expected {VERSION})")
    if fp.rstrip(b"\0").decode(errors="replace") != fingerprint:
        raise BlobError("blob was made under another model fingerprint")
    if c != kv.cfg.chunk_tokens:
        raise BlobError(f"blob chunk_tokens {c} differs from the pool's {kv.cfg.chunk_tokens}")
    if dtype != DTYPE_CODES[kv.pool.kv.dtype]:
        raise BlobError("blob KV dtype differs from the pool's")
    if (layers, heads, dim) != (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim):
        raise BlobError(f"blob KV shape {(layers, heads, dim)} differs from the model's")
    rsize = _record_size(kv)
    if len(mv) != hsize + n * rsize:
        raise BlobError(f"blob length {len(mv)} does not match {n} chunk records of {rsize} bytes")
    for i in range(n):
        lo = hsize + i * rsize
        (rcrc,) = struct.unpack_from("<I", mv, lo + rsize - 4)
        if zlib.crc32(mv[lo : lo + rsize - 4]) != rcrc:
            raise BlobError(f"chunk record {i} is corrupt (checksum mismatch)")
    return n


def deserialize(kv: PagedKV, blob: bytes, fingerprint: str) -> int:
    """Restores a blob into an empty sequence; validates it all before writing anything.

    Chunks that were resident go to the pool while the budget leaves room for the append head and
    the tail; the rest go to the host tier. Returns the number of tokens restored.
    """
    if len(kv.seq):
        raise KVFlashError("deserialize needs an empty sequence")
    n = _validate(kv, blob, fingerprint)
    c = kv.cfg.chunk_tokens
    mv = memoryview(blob)
    rsize, pos = _record_size(kv), HEADER.size + 4
    sum_shape = kv.summary_shape
    sum_bytes = 4 * sum_shape.numel()
    gpu_room = max(0, kv.budget - kv.cfg.floor_chunks() + 1)
    kv.seq.ensure_chunks(n * c)
    for i in range(n):
        rec = bytearray(mv[pos + i * rsize : pos + (i + 1) * rsize])  # writable, for frombuffer
        was_resident, score = RECORD_HEAD.unpack_from(rec, 0)
        off = RECORD_HEAD.size
        kv.seq.tokens.extend(struct.unpack_from(f"<{c}i", rec, off))
        off += 4 * c
        summary = torch.frombuffer(rec, dtype=torch.float32, offset=off, count=sum_bytes // 4)
        off += sum_bytes
        data = torch.frombuffer(rec, dtype=torch.uint8, offset=off, count=rsize - 4 - off)
        ch = kv.seq.chunks[i]
        if was_resident and gpu_room:
            ch.gpu = kv.pool.alloc()
            dest = kv.pool.kv[ch.gpu]
            gpu_room -= 1
        else:
            ch.host = kv.host.alloc()
            dest = kv.host.view(ch.host)
        dest.view(torch.uint8).view(-1).copy_(data)
        kv.seq.set_summary(i, summary.view(sum_shape).to(kv.pool.kv.device))
        ch.sealed, ch.score = True, score
    return n * c
