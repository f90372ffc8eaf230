"""What touching host memory costs on this machine: its first use against its reuse.

A virtual machine's memory may be backed by its host only when the guest first touches it, so the
first process to use a page pays the host's fault on top of the guest's, and later processes reuse
pages already backed. This touches --gib GiB (default: all the memory available but --keep GiB),
--block GiB at a time, in --passes processes one after another (each frees its memory to the
kernel as it exits), and reports each block's seconds a GiB. Where the first pass is several times
slower than the next, a process that is the machine's first to use its memory (a machine's first
server) pays that in its turns; a pass also leaves the memory it touched backed for the processes
after it.

    python -m bench.host_memory --passes 2 --out out/host_memory
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.harness import out_dir, progress_bar, pyplot, run_meta, save_png, write_json

GIB = 1 << 30


def available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    raise SystemExit("no MemAvailable in /proc/meminfo: python -m bench.host_memory needs Linux")


def touch_pass(blocks: int, block_gib: float, conn) -> None:
    """In a process of its own: allocates and writes `blocks` blocks, all kept until the end, and
    sends each one's seconds (torch's threads write them, as a server's pinned blocks are)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    kept = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        block = torch.empty(int(block_gib * GIB), dtype=torch.uint8)
        block.fill_(1)
        kept.append(block)
        conn.send(time.perf_counter() - t0)
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gib", type=float, default=None, help="GiB a pass touches (default: available less --keep)"
    )
    ap.add_argument("--keep", type=float, default=8.0, help="GiB left untouched when --gib is not given")
    ap.add_argument("--block", type=float, default=2.0, help="GiB allocated and written at a time")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default="out/host_memory")
    args = ap.parse_args()
    total = args.gib if args.gib is not None else available_gib() - args.keep
    blocks = int(total // args.block)
    if blocks < 1:
        raise SystemExit(f"{total:.1f} GiB to touch is less than one block of {args.block:g} GiB")
    ctx = multiprocessing.get_context("spawn")
    passes: list[list[float]] = []
    with progress_bar() as progress:
        task = progress.add_task("blocks touched", total=blocks * args.passes)
        for _ in range(args.passes):
            here, there = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=touch_pass, args=(blocks, args.block, there))
            proc.start()
            there.close()
            secs = []
            for _ in range(blocks):
                secs.append(here.recv())
                progress.advance(task)
            proc.join()
            passes.append(secs)
    table = Table(title=f"touching {blocks * args.block:g} GiB of host memory, {args.block:g} GiB at a time")
    for col in ("pass", "s a GiB: mean", "first block", "slowest block", "fastest block", "pass s"):
        table.add_column(col, justify="right")
    for i, secs in enumerate(passes, 1):
        per = [s / args.block for s in secs]
        table.add_row(str(i), f"{sum(per) / len(per):.2f}", f"{per[0]:.2f}", f"{max(per):.2f}",
                      f"{min(per):.2f}", f"{sum(secs):.1f}")  # fmt: skip
    Console().print(table)
    out = out_dir(args.out)
    meta = run_meta(block_gib=args.block, blocks=blocks, available_gib=available_gib())
    write_json(out / "host_memory.json", {"meta": meta, "passes": passes})
    plot(passes, args.block, out / "host_memory.png")


def plot(passes: list[list[float]], block_gib: float, path: Path) -> None:
    """Seconds a GiB of each block, one line a pass."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, secs in enumerate(passes, 1):
        ax.plot(
            [block_gib * (j + 1) for j in range(len(secs))], [s / block_gib for s in secs], label=f"pass {i}"
        )
    ax.set_xlabel("GiB touched")
    ax.set_ylabel("seconds a GiB")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    main()
