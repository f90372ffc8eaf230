"""A sampling profiler for any Python process of a benchmark: put this folder on PYTHONPATH and set
KVFLASH_STACKS=PREFIX; every thread's stack is sampled every KVFLASH_STACKS_MS (5) ms and, when the
process exits, the counts of each collapsed stack (thread name; outermost frame first) are written
to PREFIX.<pid>.txt, one `count thread;file:function;...` line each (flame-graph tools read it).

With KVFLASH_STACKS_BUCKET_S set (seconds, e.g. 0.1), each line starts with the sample's time bucket
on the epoch clock (`int(time.time() / bucket)`, as the answers' `arrival_time` and
`finished_time`: `bucket count thread;...`), so one phase of a run (a turn's prefill, say) can be
picked out afterwards by its times.

Every garbage collection that takes a millisecond or more is written to PREFIX.<pid>.gc.txt as
`start_epoch_s ms generation collected`: a collection holds the interpreter, so it shows in the
stacks only as a slow frame of whatever allocated last.

It needs no ptrace and no package: the `kvflash serve` processes a benchmark starts are profiled
as they run, which a profiler attached from outside cannot do on every machine."""

import atexit
import gc
import os
import sys
import threading
import time
from collections import Counter

_prefix = os.environ.get("KVFLASH_STACKS")
if _prefix:
    _period = float(os.environ.get("KVFLASH_STACKS_MS", "5")) / 1000
    _bucket = float(os.environ.get("KVFLASH_STACKS_BUCKET_S") or 0)
    _counts: Counter[tuple[int, str]] = Counter()
    """(time bucket, or 0 without buckets; collapsed stack) -> samples."""
    _collections: list[tuple[float, float, int, int]] = []
    """(start epoch s, ms, generation, objects collected) of each collection of 1 ms or more."""
    _gc_start = [0.0, 0.0]

    def _name(frame) -> str:
        code = frame.f_code
        return f"{os.path.basename(code.co_filename)}:{code.co_name}"

    def _sample() -> None:
        while True:
            time.sleep(_period)
            names = {t.ident: t.name for t in threading.enumerate()}
            when = int(time.time() / _bucket) if _bucket else 0
            for ident, frame in sys._current_frames().items():
                if ident == _me_sampler[0]:
                    continue
                stack = []
                while frame is not None:
                    stack.append(_name(frame))
                    frame = frame.f_back
                _counts[when, ";".join([names.get(ident, str(ident)), *reversed(stack)])] += 1

    def _collected(phase: str, info: dict) -> None:
        if phase == "start":
            _gc_start[:] = time.time(), time.perf_counter()
            return
        ms = (time.perf_counter() - _gc_start[1]) * 1e3
        if ms >= 1:
            _collections.append((_gc_start[0], ms, info["generation"], info["collected"]))

    def _write() -> None:
        with open(f"{_prefix}.{os.getpid()}.txt", "w") as f:
            for (when, stack), n in _counts.most_common():
                f.write(f"{when} {n} {stack}\n" if _bucket else f"{n} {stack}\n")
        with open(f"{_prefix}.{os.getpid()}.gc.txt", "w") as f:
            f.writelines(f"{t:.3f} {ms:.1f} {gen} {n}\n" for t, ms, gen, n in _collections)

    _me_sampler = [0]
    _t = threading.Thread(target=_sample, name="kvflash-stacks", daemon=True)
    _t.start()
    _me_sampler[0] = _t.ident
    gc.callbacks.append(_collected)
    atexit.register(_write)
