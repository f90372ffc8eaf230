"""Removing one snapshot from stores of growing size: what a session's every save pays to remove the
snapshot it replaces.

Each store holds --docs snapshots of --chunks chunks each (small chunks: a removal's cost is in
index rows and file names, not in the bytes), then, --repeats times, a three-chunk snapshot is
saved and removed two ways: `rm` (decided on the snapshot's own rows, only its files unlinked) and
the same decision taken on the whole index with every file of the store swept for orphans, as a
prune does (`Maintenance._remove` without `only`, what `rm` did before). Median milliseconds.

    python -m bench.removal --docs 1 10 50 --chunks 1000 --out out/removal
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import out_dir, progress_bar, pyplot, save, save_png
from kvflash.storage import ROOT_HASH, ChunkBlob, SnapshotStore
from kvflash.storage.maintenance import _plan_rm

FP = "fp-removal-bench"
SHAPE = (2, 2, 1, 16, 8)
"""[L, 2, Hkv, C, D] of every chunk: small, as the cost measured is per chunk, not per byte."""


def chain(n: int, start: int) -> list[ChunkBlob]:
    out, parent = [], ROOT_HASH
    kv = torch.zeros(SHAPE, dtype=torch.bfloat16)
    summary = torch.zeros(SHAPE[0], SHAPE[2], 4, SHAPE[4])
    for i in range(n):
        tokens = list(range((start + i) * SHAPE[3], (start + i + 1) * SHAPE[3]))
        blob = ChunkBlob.build(FP, i, parent, tokens, summary, kv)
        out.append(blob)
        parent = blob.chain_hash
    return out


def removals(st: SnapshotStore, repeats: int) -> dict[str, float]:
    """Median ms of `rm` and of the whole-store removal, each of a fresh three-chunk snapshot."""
    times: dict[str, list[float]] = {"rm": [], "whole store": []}
    for r in range(repeats):
        for way in times:
            sid = st.put_snapshot("turn", FP, chain(3, start=9 * 10**7 + 10 * r + 5 * (way == "rm")))
            t0 = time.perf_counter()
            if way == "rm":
                st.rm(sid)
            else:
                st.maintenance._remove(partial(_plan_rm, snapshot_id=sid), dry_run=False)
            times[way].append(1e3 * (time.perf_counter() - t0))
    return {way: statistics.median(ms) for way, ms in times.items()}


def table(rows: list[dict]) -> Table:
    t = Table(title="removing one snapshot, ms (median)")
    for col in ("chunks in the store", "rm", "whole store (as a prune)", "ratio"):
        t.add_column(col, justify="right")
    for r in rows:
        ratio = r["whole store"] / r["rm"]
        t.add_row(f"{r['store_chunks']:,}", f"{r['rm']:.1f}", f"{r['whole store']:.1f}", f"{ratio:.0f}x")
    return t


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    n = [r["store_chunks"] for r in rows]
    ax.plot(n, [r["rm"] for r in rows], "o-", label="rm (its own rows and files)")
    ax.plot(n, [r["whole store"] for r in rows], "s--", label="the same removal over the whole store")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("chunks in the store")
    ax.set_ylabel("ms to remove a 3-chunk snapshot")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, nargs="+", default=[1, 10, 50], help="snapshots in each store")
    ap.add_argument("--chunks", type=int, default=1000, help="chunks of each of those snapshots")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the stores are made (default: a temp dir)")
    ap.add_argument("--out", default="out/removal")
    args = ap.parse_args()
    out = out_dir(args.out)
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, progress_bar(console) as progress:
        task = progress.add_task("stores", total=sum(args.docs))
        for docs in args.docs:
            with SnapshotStore(Path(tmp) / f"store-{docs}") as st:
                for d in range(docs):
                    st.put_snapshot(f"doc {d}", FP, chain(args.chunks, start=(d + 1) * 10**6))
                    progress.advance(task)
                rows.append({"store_chunks": docs * args.chunks, **removals(st, args.repeats)})
    console.print(table(rows))
    save(console, out / "removal", rows, plot, args)


if __name__ == "__main__":
    main()
