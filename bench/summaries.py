"""The first read of a lazy restore: `SnapshotStore.read_summaries` of one long snapshot (the token
ids and key summaries of every chunk), from the page cache and cold (every file of the store dropped
from it with posix_fadvise DONTNEED before each read): from the snapshot's summaries file, then with
that file removed, from the chunk files (as a snapshot without one is read).

Synthetic chunks of SmolLM2-135M's shape by default: KV [30, 2, 3, 64, 64] bf16 (one random tensor
shared by every chunk: only the summaries are read), summaries [30, 3, 4, 64] fp32, 92 KB a chunk.
The store is made under --dir and removed at the end.

    python -m bench.summaries --chunks 2048 --out out/summaries.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import out_dir, write_json
from kvflash.storage import ROOT_HASH, ChunkBlob, SnapshotStore

FP = "bench-summaries"


def chain(n: int, layers: int, heads: int, chunk: int, dim: int, blocks: int) -> list[ChunkBlob]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn((layers, 2, heads, chunk, dim), generator=g).to(torch.bfloat16)
    blobs, parent = [], ROOT_HASH
    for i in range(n):
        summary = torch.randn((layers, heads, blocks, dim), generator=g)
        blobs.append(ChunkBlob.build(FP, i, parent, range(i * chunk, (i + 1) * chunk), summary, kv))
        parent = blobs[-1].chain_hash
    return blobs


def drop_cache(root: Path) -> None:
    """Evicts the clean pages of every file of the store, so the next read comes from the device."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_reads(st: SnapshotStore, hashes: list[str], shape: tuple[int, ...], repeats: int, cold: bool):
    """Seconds of each read_summaries into a fresh fp32 `[n, L, Hkv, B, D]` tensor (as a restore)."""
    times = []
    for _ in range(repeats):
        if cold:
            drop_cache(st.root)
        out = torch.empty((len(hashes), *shape))
        t0 = time.perf_counter()
        st.read_summaries(hashes, FP, out)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=2048)
    ap.add_argument("--shape", type=int, nargs=4, default=(30, 3, 64, 64), metavar=("L", "HKV", "C", "D"))
    ap.add_argument("--summary-blocks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="where the store is made (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="JSON of the timings")
    args = ap.parse_args()
    layers, heads, chunk, dim = args.shape
    work = Path(tempfile.mkdtemp(prefix="kvflash-summaries-", dir=args.dir))
    try:
        blobs = chain(args.chunks, layers, heads, chunk, dim, args.summary_blocks)
        with SnapshotStore(work / "store") as st:
            t0 = time.perf_counter()
            sid = st.put_snapshot("doc", FP, blobs)
            save_s = time.perf_counter() - t0
            hashes = list(st.get_snapshot(sid).chunk_hashes)
            shape = tuple(blobs[0].summary.shape)
            result = {"chunks": args.chunks, "summary_bytes": 4 * blobs[0].summary.numel(), "save_s": save_s}
            for source in ("summaries_file", "chunk_files"):
                if source == "chunk_files":
                    st.backend.delete_summaries(hashes[-1])
                result[source] = {
                    "warm_s": timed_reads(st, hashes, shape, args.repeats, cold=False),
                    "cold_s": timed_reads(st, hashes, shape, args.repeats, cold=True),
                }
    finally:
        shutil.rmtree(work)
    for source in ("summaries_file", "chunk_files"):
        for kind in ("warm_s", "cold_s"):
            times = [round(t, 3) for t in result[source][kind]]
            print(f"{source:>14} {kind[:-2]:>4}: median {statistics.median(times):.3f} s  {times}")
    print(f"save: {save_s:.1f} s for {args.chunks} chunks")
    if args.out:
        out_dir(args.out.parent)
        write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
