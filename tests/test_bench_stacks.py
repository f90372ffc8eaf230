"""bench/stacks (the sampling profiler benchmarks run their processes under) and bench.stacks_report,
on a real child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.stacks_report import collections_in, window_samples

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import gc, time
def busy():
    t = time.perf_counter()
    while time.perf_counter() - t < 0.3:
        pass
start = time.time()
busy()
junk = [[i] for i in range(300_000)]
gc.collect()
print(start, time.time())
"""


def test_sampled_stacks_and_collections_land_in_the_process_window(tmp_path) -> None:
    """A child run under the profiler: its main thread's samples in the epoch window it printed are
    mostly inside `busy`, and its forced full collection is recorded in the window, generation 2."""
    env = os.environ | {
        "PYTHONPATH": f"{ROOT / 'bench' / 'stacks'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "KVFLASH_STACKS": str(tmp_path / "s"),
        "KVFLASH_STACKS_BUCKET_S": "0.1",
    }
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    start, end = map(float, out.stdout.split())
    (stacks,) = tmp_path.glob("s.*[0-9].txt")
    samples = window_samples(stacks, 0.1, start, end, "MainThread")
    assert len(samples) >= 20
    assert sum("<string>:busy" in s for s in samples) > len(samples) / 2
    before = window_samples(stacks, 0.1, start - 60, start - 1, "MainThread")
    assert before == []
    gcs = collections_in(stacks.with_suffix(".gc.txt"), start, end + 1)
    assert any(gen == 2 for _, _, gen in gcs)
