"""Where one thread's samples went over a time window, from the files bench/stacks wrote with
KVFLASH_STACKS_BUCKET_S: per process, the share of the window the thread was seen in, its frames
by inclusive share (a frame counts once a sample wherever it is on the stack), and the garbage
collections that started in the window.

The window is on the epoch clock, as serve_batch's `server_window` of a turn, so the scheduler
thread's turn 1 in a slow server can be set beside a fast one's:

    python -m bench.stacks_report --stacks out/st --window 1796441541.2 1796441542.9
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from rich.console import Console
from rich.table import Table


def window_samples(path: Path, bucket_s: float, start: float, end: float, thread: str) -> list[list[str]]:
    """The stacks (outermost frame first) of `thread`'s samples whose bucket lies in the window,
    each repeated as often as it was seen."""
    lo, hi = int(start / bucket_s), int(end / bucket_s)
    stacks = []
    for line in path.read_text().splitlines():
        when, n, stack = line.split(" ", 2)
        frames = stack.split(";")
        if lo <= int(when) <= hi and frames[0] == thread:
            stacks += [frames[1:]] * int(n)
    return stacks


def collections_in(path: Path, start: float, end: float) -> list[tuple[float, float, int]]:
    """(seconds into the window, ms, generation) of each collection that started in it."""
    if not path.exists():
        return []
    rows = (line.split() for line in path.read_text().splitlines())
    return [(float(t) - start, float(ms), int(g)) for t, ms, g, _ in rows if start <= float(t) <= end]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stacks", required=True, help="the folder of PREFIX.<pid>.txt files")
    ap.add_argument("--window", nargs=2, type=float, required=True, metavar=("START", "END"))
    ap.add_argument("--thread", default="kvflash-scheduler")
    ap.add_argument("--bucket-s", type=float, default=0.1, help="the run's KVFLASH_STACKS_BUCKET_S")
    ap.add_argument("--period-ms", type=float, default=5, help="the run's KVFLASH_STACKS_MS")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    start, end = args.window
    expected = (
        (int(end / args.bucket_s) - int(start / args.bucket_s) + 1) * args.bucket_s * 1e3 / args.period_ms
    )
    console = Console()
    for path in sorted(Path(args.stacks).glob("*[0-9].txt")):
        stacks = window_samples(path, args.bucket_s, start, end, args.thread)
        if not stacks:
            continue
        inclusive = collections.Counter(f for s in stacks for f in dict.fromkeys(s))
        seen = f"{len(stacks)} samples ({len(stacks) / expected:.0%} of the window)"
        t = Table(title=f"{path.name}: {args.thread}, {seen}")
        t.add_column("frame")
        t.add_column("share", justify="right")
        for frame, n in inclusive.most_common(args.top):
            t.add_row(frame, f"{n / len(stacks):.0%}")
        console.print(t)
        gcs = collections_in(path.with_suffix(".gc.txt"), start, end)
        console.print(f"collections: {len(gcs)}, {sum(ms for _, ms, _ in gcs):.0f} ms", gcs[:10])


if __name__ == "__main__":
    main()
