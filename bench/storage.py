"""Snapshot store benchmark: compression ratio and save/restore throughput against the raw disk.

The raw disk is measured in the same run on the same directory: files of the same sizes as the chunk
files, written with fsync and read back with the same number of threads after their pages are
dropped from the page cache (posix_fadvise DONTNEED). Restores are timed cold the same way, then
warm, into a fresh tensor per chunk; then cold again into destinations allocated and written before
the clock starts, as the engine restores into its host tier (pinned memory on a GPU host), so that
restore pays no page faults for its output. Target (issue 5): a cold restore reaches >= 80% of the
raw read speed, counting stored bytes.

Input: `--kv-file` safetensors whose 5-D tensors are chunks `[L, 2, Hkv, C, D]` (in name order) or
whose 6-D tensor stacks them; otherwise synthetic bf16 KV with SmolLM2-135M's shape (the output
says which).

    python bench/storage.py --out docs/storage.json
    python bench/storage.py --kv-file smollm2_kv.safetensors --dir /mnt/nvme/kvbench --out ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvflash.config import ResidencyConfig
from kvflash.paths import kvflash_home
from kvflash.storage import ROOT_HASH, ChunkBlob, SnapshotStore
from kvflash.storage.codec import fp8_error
from kvflash.storage.store import MAX_DEFAULT_WORKERS

SMOLLM2 = (30, 3, 64, 64)
"""SmolLM2-135M: layers, kv-heads, chunk tokens, head dim."""
FP = "bench-fingerprint"
CODECS = [("lossless", 1), ("lossless", 3), ("fp8", 3)]
MB = 1e6


@dataclass
class Row:
    codec: str
    level: int
    ratio: float
    save_s: float
    save_raw_mbps: float
    save_stored_mbps: float
    restore_cold_s: float
    restore_cold_stored_mbps: float
    restore_cold_raw_mbps: float
    restore_warm_stored_mbps: float
    restore_slots_cold_stored_mbps: float
    """Cold restore into destinations allocated (and faulted in) before it, like host-tier slots."""
    restore_async_cold_stored_mbps: float
    fp8_max_rel_err: float | None
    of_raw_read: float = 0.0
    """Cold restore speed in stored bytes over the raw disk's cold read speed."""
    of_raw_read_slots: float = 0.0
    """The same for the restore into allocated destinations."""


def synthetic_kv(n_chunks: int, layers: int, heads: int, chunk: int, dim: int) -> list[torch.Tensor]:
    """Llama-like KV: keys with per-channel offsets and log-normal channel scales (a few outlier
    channels), rotated by RoPE over positions; values smaller and unrotated. bf16."""
    g = torch.Generator().manual_seed(0)
    shape = (layers, heads, dim)
    k_scale = torch.exp(torch.randn(shape, generator=g) * 0.8)
    k_bias = torch.randn(shape, generator=g) * k_scale
    v_scale = torch.exp(torch.randn(shape, generator=g) * 0.5) * 0.3
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    out = []
    for i in range(n_chunks):
        pos = torch.arange(i * chunk, (i + 1) * chunk).float()
        ang = pos[:, None] * inv_freq[None]  # [C, D/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        k = (
            k_bias[:, :, None]
            + torch.randn(layers, heads, chunk, dim, generator=g) * k_scale[:, :, None] * 0.5
        )
        half = dim // 2
        rot = torch.cat([-k[..., half:], k[..., :half]], -1)
        k = k * cos + rot * sin
        v = torch.randn(layers, heads, chunk, dim, generator=g) * v_scale[:, :, None]
        out.append(torch.stack([k, v], 1).to(torch.bfloat16))
    return out


def load_kv_file(path: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    chunks = [tensors[k] for k in sorted(tensors) if tensors[k].dim() == 5]
    for k in sorted(tensors):
        if tensors[k].dim() == 6:
            chunks += list(tensors[k].unbind(0))
    if not chunks:
        raise SystemExit(f"{path}: no 5-D chunk tensors [L, 2, Hkv, C, D] or 6-D stack of them")
    return chunks


def as_blobs(kvs: list[torch.Tensor], blocks: int) -> list[ChunkBlob]:
    """Chunks with the engine's summary: the mean key of each of `blocks` equal runs, [L, Hkv, B, D]."""
    blobs, parent = [], ROOT_HASH
    for i, kv in enumerate(kvs):
        L, _, H, c, D = kv.shape
        if c % blocks:
            raise SystemExit(f"--summary-blocks {blocks} does not divide the chunk's {c} tokens")
        summary = kv[:, 0].float().reshape(L, H, blocks, c // blocks, D).mean(3)
        blob = ChunkBlob.build(FP, i, parent, list(range(i * c, (i + 1) * c)), summary, kv)
        blobs.append(blob)
        parent = blob.chain_hash
    return blobs


def drop_cache(paths: list[Path]) -> None:
    """Evicts the files' clean pages, so the next read comes from the device."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_disk(directory: Path, sizes: list[int], workers: int) -> tuple[float, float]:
    """(write MB/s with fsync, cold read MB/s) for files of the given sizes."""
    directory.mkdir(parents=True)
    data = os.urandom(max(sizes))
    paths = [directory / f"f{i}" for i in range(len(sizes))]
    t = time.perf_counter()
    for p, n in zip(paths, sizes, strict=True):
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, memoryview(data)[:n])
        os.fsync(fd)
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    write_s = time.perf_counter() - t
    drop_cache(paths)
    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda p: p.read_bytes(), paths))
    read_s = time.perf_counter() - t
    shutil.rmtree(directory)
    return sum(sizes) / write_s / MB, sum(sizes) / read_s / MB


def bench_codec(
    root: Path, blobs: list[ChunkBlob], codec: str, level: int, workers: int
) -> tuple[Row, list[int]]:
    raw_bytes = sum(b.kv.numel() * b.kv.element_size() for b in blobs)
    with SnapshotStore(root, codec=codec, level=level, workers=workers) as st:
        t = time.perf_counter()
        sid = st.put_snapshot("bench", FP, blobs)
        save_s = time.perf_counter() - t
        hashes = st.get_snapshot(sid).chunk_hashes
        files = [st.backend.path(h) for h in hashes]
        sizes = [f.stat().st_size for f in files]
        stored = sum(sizes)

        drop_cache(files)
        t = time.perf_counter()
        got = st.read_chunks_parallel(hashes, FP)
        cold_s = time.perf_counter() - t
        t = time.perf_counter()
        st.read_chunks_parallel(hashes, FP)
        warm_s = time.perf_counter() - t
        slots = [torch.zeros_like(b.kv) for b in blobs]
        drop_cache(files)
        t = time.perf_counter()
        st.read_chunks_parallel(hashes, FP, out=slots)
        slots_s = time.perf_counter() - t
        drop_cache(files)
        t = time.perf_counter()
        asyncio.run(st.read_chunks_async(hashes, FP))
        async_s = time.perf_counter() - t
    err = None
    if codec == "fp8":
        err = max(float(fp8_error(a.kv, b.kv).max()) for a, b in zip(blobs, got, strict=True))
    else:
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True)), "lossless mismatch"
        assert all(torch.equal(a.kv, b) for a, b in zip(blobs, slots, strict=True)), "lossless mismatch"
    row = Row(
        codec=codec,
        level=level,
        ratio=raw_bytes / stored,
        save_s=save_s,
        save_raw_mbps=raw_bytes / save_s / MB,
        save_stored_mbps=stored / save_s / MB,
        restore_cold_s=cold_s,
        restore_cold_stored_mbps=stored / cold_s / MB,
        restore_cold_raw_mbps=raw_bytes / cold_s / MB,
        restore_warm_stored_mbps=stored / warm_s / MB,
        restore_slots_cold_stored_mbps=stored / slots_s / MB,
        restore_async_cold_stored_mbps=stored / async_s / MB,
        fp8_max_rel_err=err,
    )
    return row, sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-file", type=Path, help="safetensors of chunk tensors [L, 2, Hkv, C, D]")
    ap.add_argument("--chunks", type=int, default=64, help="synthetic chunks (default 64: 4K tokens)")
    ap.add_argument(
        "--dir", type=Path, default=kvflash_home() / "bench-storage", help="scratch dir on the disk"
    )
    ap.add_argument("--workers", type=int, help="store threads (default: the store's)")
    ap.add_argument(
        "--summary-blocks",
        type=int,
        default=ResidencyConfig.summary_blocks,
        help="summary blocks per chunk (default: the engine's)",
    )
    ap.add_argument("--out", type=Path, help="path of the JSON results")
    args = ap.parse_args()
    workers = args.workers or min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1)

    if args.kv_file:
        kvs = load_kv_file(args.kv_file)
        source = f"{args.kv_file}: {len(kvs)} chunks of real KV"
    else:
        L, H, C, D = SMOLLM2
        kvs = synthetic_kv(args.chunks, L, H, C, D)
        source = f"synthetic bf16 KV, SmolLM2-135M shape, {args.chunks} chunks (not real model KV)"
    blobs = as_blobs(kvs, args.summary_blocks)
    raw_bytes = sum(b.kv.numel() * b.kv.element_size() for b in blobs)

    if args.dir.exists():
        shutil.rmtree(args.dir)
    con = Console()
    con.print(f"input: {source}; {raw_bytes / MB:.1f} MB of KV; dir {args.dir}; {workers} threads")
    rows, sizes = [], []
    for i, (codec, level) in enumerate(CODECS):
        row, files = bench_codec(args.dir / f"store{i}", blobs, codec, level, workers)
        rows.append(row)
        sizes = sizes or files
    # the raw disk gets files of the first (lossless) store's sizes: the bytes its restore reads
    raw = raw_disk(args.dir / "raw", sizes, workers)
    for r in rows:
        r.of_raw_read = r.restore_cold_stored_mbps / raw[1]
        r.of_raw_read_slots = r.restore_slots_cold_stored_mbps / raw[1]
    shutil.rmtree(args.dir)

    t = Table(
        title=f"snapshot store (raw disk: write {raw[0]:.0f} MB/s fsync'd, read {raw[1]:.0f} MB/s cold)"
    )
    for col in ("codec", "ratio", "save MB/s raw|stored", "restore cold MB/s stored|raw", "of raw read"):
        t.add_column(col)
    for col in ("into slots: cold MB/s", "of raw read", "warm MB/s", "async cold MB/s", "fp8 max rel err"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            f"{r.codec} (zstd {r.level})", f"{r.ratio:.2f}x",
            f"{r.save_raw_mbps:.0f} | {r.save_stored_mbps:.0f}",
            f"{r.restore_cold_stored_mbps:.0f} | {r.restore_cold_raw_mbps:.0f}",
            f"{r.of_raw_read:.0%}", f"{r.restore_slots_cold_stored_mbps:.0f}",
            f"{r.of_raw_read_slots:.0%}", f"{r.restore_warm_stored_mbps:.0f}",
            f"{r.restore_async_cold_stored_mbps:.0f}",
            "" if r.fp8_max_rel_err is None else f"{r.fp8_max_rel_err:.4f}",
        )  # fmt: skip
    con.print(t)
    if args.out:
        meta = {
            "input": source,
            "kv_bytes": raw_bytes,
            "chunk_shape": list(blobs[0].kv.shape),
            "summary_shape": list(blobs[0].summary.shape),
            "dir": str(args.dir),
            "workers": workers,
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "torch": torch.__version__,
            "raw_write_mbps": raw[0],
            "raw_read_mbps": raw[1],
        }
        args.out.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
