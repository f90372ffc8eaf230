"""`kvflash serve` that reports on its own memory, for bench/server_memory.py.

`python -m bench.memory_report serve ARGS...` is `kvflash serve ARGS...` plus a thread that reads
lines `report PATH` on stdin and for each writes JSON to PATH (atomically): after a gc pass, the
counts of objects by type, the bytes of live tensors grouped by shape, glibc malloc's figures
(mallinfo2), the process's threads and, with KVFLASH_TRACEMALLOC=FRAMES in the environment, the
Python allocations by line that grew since the last report (tracing starts at the first report, so
the model load, which it would slow down many times over, is not traced).

Nothing of this is in kvflash itself: the server under measurement is the one users run.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import tracemalloc
from collections import Counter
from pathlib import Path

import torch

TOP = 25
"""Entries kept per table of a report."""


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost",
    )]  # fmt: skip


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def malloc_figures() -> dict[str, int]:
    """Bytes: `heap` taken from the system by malloc's arenas (brk and arena mmaps), `mmapped` in
    chunks of their own, `in_use` and `free` inside the arenas (free pages stay resident until
    malloc_trim hands them back, which `free` still counts)."""
    m = LIBC.mallinfo2()
    return {"heap": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks, "free": m.fordblks}


def tensor_bytes() -> tuple[int, list[tuple[str, int, int]]]:
    """Bytes of the CPU storages live tensors hold (each storage once), and the TOP groups by the
    shape and dtype of the first tensor seen on a storage: (group, storages, bytes)."""
    seen: dict[int, tuple[str, int]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                st = obj.untyped_storage()
            except RuntimeError:  # a tensor without storage (sparse, functional wrappers)
                continue
            if st.data_ptr() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (
                    f"{str(obj.dtype).removeprefix('torch.')}{list(obj.shape)}",
                    st.nbytes(),
                )
    groups: Counter = Counter()
    counts: Counter = Counter()
    for key, n in seen.values():
        groups[key] += n
        counts[key] += 1
    top = [(k, counts[k], n) for k, n in groups.most_common(TOP)]
    return sum(n for _, n in seen.values()), top


class Reporter:
    def __init__(self, frames: int) -> None:
        self.frames = frames
        self._last: tracemalloc.Snapshot | None = None

    def report(self) -> dict:
        gc.collect()
        types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        total, groups = tensor_bytes()
        body = {
            "objects": sum(types.values()),
            "types": types.most_common(TOP),
            "kvflash_types": sorted((k, n) for k, n in types.items() if k.startswith("kvflash.")),
            "tensor_bytes": total,
            "tensor_groups": groups,
            "malloc": malloc_figures(),
            "threads": len(os.listdir("/proc/self/task")),
            "python_threads": sorted(t.name for t in threading.enumerate()),
        }
        if self.frames and not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        if tracemalloc.is_tracing():
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)]
            )
            body["traced_bytes"] = tracemalloc.get_traced_memory()[0]
            if self._last is not None:
                grew = snap.compare_to(self._last, "lineno")[:TOP]
                body["traced_growth"] = [(str(d.traceback), d.size_diff, d.count_diff) for d in grew]
            self._last = snap
        return body

    def serve(self) -> None:
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "report":
                tmp = Path(arg + ".tmp")
                tmp.write_text(json.dumps(self.report()))
                tmp.rename(arg)


def main() -> None:
    frames = int(os.environ.get("KVFLASH_TRACEMALLOC", "0"))
    threading.Thread(target=Reporter(frames).serve, daemon=True, name="memory-report").start()
    from kvflash.cli.app import main as kvflash

    kvflash()


if __name__ == "__main__":
    main()
