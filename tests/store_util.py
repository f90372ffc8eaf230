"""What the store's tests share: deterministic chunk chains, their paths, and ways to damage a file."""

from __future__ import annotations

import multiprocessing as mp
import zlib
from pathlib import Path

import torch
import zstandard

from kvflash.storage import (
    ROOT_HASH,
    ChunkBlob,
    codec,
    format,
)

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


def chain_fields(blob: ChunkBlob) -> tuple:
    """What places a chunk in its chain: index, chain and parent hashes, token ids."""
    return blob.index, blob.chain_hash, blob.parent_hash, blob.tokens


def toks(n_chunks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_chunks * C))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def chunk_path(root: Path, h: str) -> Path:
    return root / "chunks" / h[:2] / f"{h}.kvc"


def forkserver() -> mp.context.BaseContext:
    """Children fork from a server that imported torch once: a fresh process costs milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvflash.storage"])
    return ctx


def rewrite_header(path: Path, **fields) -> None:
    """Edits header fields and recomputes the header checksum: a file that lies consistently."""
    buf = bytearray(path.read_bytes())
    h = format.parse_header(bytes(buf), len(buf), "x" * 64)
    names = list(format.ChunkHeader.__dataclass_fields__)
    values = {n: getattr(h, n) for n in names} | fields
    buf[: format.HEADER_SIZE] = format.pack_header(format.ChunkHeader(**values))
    path.write_bytes(bytes(buf))


def flip(path: Path, offset: int) -> None:
    buf = bytearray(path.read_bytes())
    buf[offset % len(buf)] ^= 0x40
    path.write_bytes(bytes(buf))


def damage_at(head: format.ChunkHeader, where: str) -> int:
    """A file offset of a version 3 chunk file: in its token ids, in its KV's zstd blocks, or the
    byte of the one-byte (RLE) block of its summary's all-zero residual, before the end block (3
    bytes) and the frame checksum (4)."""
    return {
        "token id": format.HEADER_SIZE + 5,
        "kv": format.HEADER_SIZE + head.meta_len + head.stored_len // 2,
        "summary residual": -8,
    }[where]


def noise_chain(n_chunks: int, start: int, shape=(2, 2, 4, 64, 64)) -> list[ChunkBlob]:
    """fp32 noise, 256 KiB a chunk: it barely compresses, so the bytes on disk are predictable."""
    blobs, parent = [], ROOT_HASH
    for i in range(n_chunks):
        run = list(range(start + i * shape[3], start + (i + 1) * shape[3]))
        kv = torch.randn(shape, generator=torch.Generator().manual_seed(start + i))
        blob = ChunkBlob.build(FP, i, parent, run, torch.zeros(shape[0], shape[2], B, shape[4]), kv)
        blobs.append(blob)
        parent = blob.chain_hash
    return blobs


def version2_file(blob: ChunkBlob, level: int = 1) -> bytes:
    """The chunk file a kvflash of format version 2 wrote for a blob: header, token ids, the summary
    section, then one zstd frame of the KV's byte planes (codec 1; fp8 KV in codec 2, as held)."""
    kv = blob.kv.contiguous()
    tokens = format.token_bytes(blob.tokens)
    meta = tokens + blob.summary.numpy().astype("<f4").tobytes()
    if kv.dtype == torch.float8_e4m3fn:
        codec_id, raw = format.Codec.FP8, bytes(codec._fp8_held_raw(kv))
    else:
        codec_id, raw = format.Codec.LOSSLESS, bytes(codec.split_planes(kv))
    payload = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)
    h = format.ChunkHeader(
        version=2, codec=codec_id, dtype=kv.dtype, fingerprint=blob.fingerprint, index=blob.index,
        chain_hash=blob.chain_hash, parent_hash=blob.parent_hash, shape=codec.kv_shape(kv),
        n_tokens=len(blob.tokens), summary_blocks=blob.summary.shape[2], raw_len=len(raw),
        stored_len=len(payload), raw_crc=zlib.crc32(raw), stored_crc=zlib.crc32(payload),
        meta_crc=zlib.crc32(meta),
    )  # fmt: skip
    return format.pack_header(h) + meta + payload


def write_version2(root: Path, blobs: list[ChunkBlob]) -> None:
    """Replaces the stored chunk files of `blobs` by the files format version 2 wrote."""
    for b in blobs:
        chunk_path(root, b.chain_hash).write_bytes(version2_file(b))
