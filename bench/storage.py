"""Snapshot store benchmark: compression ratio and save/restore throughput against the raw disk.

Every cold restore comes right after a raw cold read of the same files (their pages dropped with
posix_fadvise DONTNEED before each), read the way a restore reads them minus the decoding: all
hinted at once (WILLNEED), then read by as many threads as the restore uses into reused buffers.
Each restore's share is against the read just before it, so a disk whose speed drifts between runs
(docs/BENCHMARKS.md: Snapshot store) does not skew the ratio; --repeats pairs per kind, median share.
Kinds: into fresh tensors, into destinations allocated before the clock starts and without the
chunks' summaries (as the engine restores into its host-tier slots), and the same with the store's
threads only (no decode processes). Then warm restores (files in the page cache: what decoding
sustains). The raw write (fsync'd files of the chunk files' sizes) is measured at the end.
Target: a cold restore reaches >= 80% of the raw read speed, counting stored bytes.

Input: `--kv-file` safetensors whose 5-D tensors are chunks `[L, 2, Hkv, C, D]` (in name order) or
whose 6-D tensor stacks them; otherwise synthetic bf16 KV with SmolLM2-135M's shape (the output
says which).

    python -m bench.storage --out docs/storage.json
    python -m bench.storage --kv-file smollm2_kv.safetensors --dir /mnt/nvme/kvbench --out ...
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import progress_bar, pyplot, save_png, write_json
from kvflash.config import ResidencyConfig
from kvflash.paths import kvflash_home
from kvflash.storage import ROOT_HASH, ChunkBlob, SnapshotStore
from kvflash.storage.codec import CODEC_NAMES, fp8_error
from kvflash.storage.store import MAX_DEFAULT_WORKERS
from kvflash.storage.workers import default_processes

SMOLLM2 = (30, 3, 64, 64)
"""SmolLM2-135M: layers, kv-heads, chunk tokens, head dim."""
FP = "bench-fingerprint"
CODECS = [("lossless", 1), ("lossless", 3), ("fp8", 1)]
"""Level 1 is the store default (fp8 at level 3 measured the same: ratio 1.156x, 0.90 ms a chunk to
decompress on the 2-core VM)."""
MB = 1e6


@dataclass
class Row:
    codec: str
    level: int
    ratio: float
    save_s: float
    save_raw_mbps: float
    save_stored_mbps: float
    cold_mbps: list[tuple[float, float]]
    """(cold restore into fresh tensors, the raw cold read of the same files just before it), MB/s
    of stored bytes, once per repeat; the restore decodes in processes when the store has them."""
    slots_mbps: list[tuple[float, float]]
    """The same into destinations allocated (and faulted in) before it, like host-tier slots, and
    without the chunks' summaries, as the engine restores."""
    threads_slots_mbps: list[tuple[float, float]]
    """The same with the store's threads alone."""
    warm_mbps: float
    warm_threads_mbps: float
    fp8_max_rel_err: float | None

    @property
    def raw_read_mbps(self) -> list[float]:
        return [
            raw for pairs in (self.cold_mbps, self.slots_mbps, self.threads_slots_mbps) for _, raw in pairs
        ]

    @staticmethod
    def share(pairs: list[tuple[float, float]]) -> float:
        """Median over repeats of a restore's speed over the raw read measured just before it."""
        return statistics.median(r / raw for r, raw in pairs)


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


def raw_write(directory: Path, sizes: list[int]) -> float:
    """MB/s writing files of the given sizes with fsync (and the directory's), as a save does."""
    directory.mkdir(parents=True)
    data = os.urandom(max(sizes))
    t = time.perf_counter()
    for i, n in enumerate(sizes):
        fd = os.open(directory / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, memoryview(data)[:n])
        os.fsync(fd)
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    write_s = time.perf_counter() - t
    shutil.rmtree(directory)
    return sum(sizes) / write_s / MB


def raw_read(files: list[Path], threads: int) -> float:
    """MB/s of the files' cold read, done the way a restore reads them but without decoding: every
    file hinted at once (WILLNEED), then read by `threads` threads into reused buffers."""
    drop_cache(files)
    local = threading.local()

    def read(p: Path) -> int:
        fd = os.open(p, os.O_RDONLY)
        try:
            n = os.fstat(fd).st_size
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < n:
                buf = local.buf = bytearray(n)
            return os.readv(fd, [memoryview(buf)[:n]])
        finally:
            os.close(fd)

    t = time.perf_counter()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.close(fd)
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    return total / (time.perf_counter() - t) / MB


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_codec(
    root: Path, blobs: list[ChunkBlob], codec: str, level: int, workers: int, processes: int, repeats: int
) -> Row:
    raw_bytes = sum(b.kv.numel() * b.kv.element_size() for b in blobs)
    shape, dtype = tuple(blobs[0].kv.shape), blobs[0].kv.dtype
    with (
        SnapshotStore(root, codec=codec, level=level, workers=workers, processes=processes) as st,
        SnapshotStore(root, workers=workers) as threads,
    ):
        if st.processes is not None:
            st.processes.wait()  # each worker imports torch: keep that out of the save's clock
        t = time.perf_counter()
        sid = st.put_snapshot("bench", FP, blobs)
        save_s = time.perf_counter() - t
        hashes = st.get_snapshot(sid).chunk_hashes
        files = [st.backend.path(h) for h in hashes]
        stored = sum(f.stat().st_size for f in files)
        mbps = lambda s: stored / s / MB  # noqa: E731
        read_threads = max(workers, processes)
        slots = [torch.zeros_like(b.kv) for b in blobs]
        got: list[ChunkBlob] = []
        restores = {
            "cold": lambda: got.__setitem__(slice(None), st.read_chunks_parallel(hashes, FP, shape, dtype)),
            "slots": lambda: st.read_chunks_parallel(hashes, FP, out=slots, with_summary=False),
            "threads": lambda: threads.read_chunks_parallel(hashes, FP, out=slots, with_summary=False),
        }
        pairs: dict[str, list[tuple[float, float]]] = {k: [] for k in restores}
        for _ in range(repeats):
            for kind, restore in restores.items():
                raw = raw_read(files, read_threads)
                drop_cache(files)
                pairs[kind].append((mbps(timed(restore)), raw))
        warm = mbps(min(timed(restores["slots"]) for _ in range(3)))
        warm_threads = mbps(min(timed(restores["threads"]) for _ in range(3)))
    err = None
    if codec == "fp8":
        err = max(float(fp8_error(a.kv, b.kv).max()) for a, b in zip(blobs, got, strict=True))
    else:
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True)), "lossless mismatch"
        assert all(torch.equal(a.kv, b) for a, b in zip(blobs, slots, strict=True)), "lossless mismatch"
    return Row(
        codec=codec, level=level, ratio=raw_bytes / stored, save_s=save_s,
        save_raw_mbps=raw_bytes / save_s / MB, save_stored_mbps=stored / save_s / MB,
        cold_mbps=pairs["cold"], slots_mbps=pairs["slots"], threads_slots_mbps=pairs["threads"],
        warm_mbps=warm, warm_threads_mbps=warm_threads, fp8_max_rel_err=err,
    )  # fmt: skip


def codec_level(text: str) -> tuple[str, int]:
    codec, _, level = text.partition(":")
    if codec not in CODEC_NAMES or not level.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected CODEC:LEVEL, CODEC one of {', '.join(CODEC_NAMES)}"
        )
    return codec, int(level)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-file", type=Path, help="safetensors of chunk tensors [L, 2, Hkv, C, D]")
    ap.add_argument("--chunks", type=int, default=64, help="synthetic chunks (default 64: 4K tokens)")
    ap.add_argument(
        "--dir", type=Path, default=kvflash_home() / "bench-storage", help="scratch dir on the disk"
    )
    ap.add_argument("--workers", type=int, help="store threads (default: the store's)")
    ap.add_argument(
        "--processes", type=int, default=default_processes(), help="decode processes (default: by cores)"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="cold restores of each kind, each after a raw read"
    )
    ap.add_argument(
        "--summary-blocks",
        type=int,
        default=ResidencyConfig.summary_blocks,
        help="summary blocks per chunk (default: the engine's)",
    )
    ap.add_argument(
        "--codecs",
        nargs="+",
        type=codec_level,
        default=CODECS,
        help="codec:zstd-level pairs, e.g. lossless:1 fp8:1 (default: all of CODECS)",
    )
    ap.add_argument("--out", type=Path, help="path of the JSON results")
    args = ap.parse_args()
    codecs = args.codecs
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
    con.print(
        f"input: {source}; {raw_bytes / MB:.1f} MB of KV; dir {args.dir}; "
        f"{workers} threads, {args.processes} decode processes"
    )
    rows = []
    with progress_bar(console=con, transient=True) as progress:
        task = progress.add_task("codecs", total=len(codecs))
        for i, (codec, level) in enumerate(codecs):
            progress.update(task, description=f"{codec} zstd {level}")
            root = args.dir / f"store{i}"
            rows.append(bench_codec(root, blobs, codec, level, workers, args.processes, args.repeats))
            progress.advance(task)
    sizes = [p.stat().st_size for p in sorted((args.dir / "store0" / "chunks").rglob("*.kvc"))]
    write = raw_write(args.dir / "raw", sizes)
    shutil.rmtree(args.dir)

    reads = [raw for r in rows for raw in r.raw_read_mbps]
    t = Table(
        title=f"snapshot store: raw disk write {write:.0f} MB/s fsync'd, cold read {min(reads):.0f}-"
        f"{max(reads):.0f} MB/s (measured before each restore; shares are against that read)"
    )
    for col in ("codec", "ratio", "save MB/s raw|stored", "cold restore MB/s (share)"):
        t.add_column(col)
    for col in ("into slots", "threads into slots", "warm procs|threads", "fp8 max rel err"):
        t.add_column(col)

    def cell(pairs: list[tuple[float, float]]) -> str:
        return f"{statistics.median(r for r, _ in pairs):.0f} ({Row.share(pairs):.0%})"

    for r in rows:
        t.add_row(
            f"{r.codec} (zstd {r.level})", f"{r.ratio:.2f}x",
            f"{r.save_raw_mbps:.0f} | {r.save_stored_mbps:.0f}",
            cell(r.cold_mbps), cell(r.slots_mbps), cell(r.threads_slots_mbps),
            f"{r.warm_mbps:.0f} | {r.warm_threads_mbps:.0f}",
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
            "processes": args.processes,
            "cpus": os.cpu_count(),
            "machine": platform.platform(),
            "torch": torch.__version__,
            "raw_write_mbps": write,
        }
        results = [asdict(r) | {"raw_read_mbps": r.raw_read_mbps} for r in rows]
        write_json(args.out, {**meta, "rows": results})
        plot_shares(results, args.out.with_suffix(".png"))


def plot_shares(rows: list[dict], path: Path) -> None:
    """Each cold restore's share of the raw read just before it (dots) and their median (bar), per
    codec and kind, with the 80 % target."""
    plt = pyplot()

    kinds = [
        ("cold_mbps", "fresh tensors"),
        ("slots_mbps", "into slots"),
        ("threads_slots_mbps", "into slots, threads"),
    ]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, (key, label) in enumerate(kinds):
        xs = [i + (k - 1) * 0.27 for i in range(len(rows))]
        shares = [[100 * a / b for a, b in r[key]] for r in rows]
        ax.bar(xs, [statistics.median(s) for s in shares], 0.25, label=label)
        for x, s in zip(xs, shares, strict=True):
            ax.plot([x] * len(s), s, "k.", ms=3)
    ax.axhline(80, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(rows)), [f"{r['codec']} zstd {r['level']}" for r in rows])
    ax.set_ylabel("% of the raw cold read")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
