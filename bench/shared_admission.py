"""Admitting N conversations over one document at the scheduler itself: where the time to their
first tokens goes besides the forwards.

N jobs, each one --doc-tokens document and a question of its own, go to one `Scheduler` at once:
the first prefills the document, the others wait for it (`Scheduler._shares_busy_prefix`) and are
then admitted together, each sharing the document's chunks (`PrefixCache.take`). The scheduler's
admission methods are wrapped with timers for the run, so the table says how much of the first
tokens' wait each took (`_admit` in all; of it the busy-prefix checks, `_make_room` and `_start`),
against the forwards (`_round`). Admission is host work whose cost grows with N; the forwards are
the device's (on the CPU, a model of a few layers, so that they do not hide the rest).

  python -m bench.shared_admission --out out/shared_admission
  python -m bench.shared_admission --device cuda --out out/shared_admission   # SmolLM2's shape
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.engine_turns import turn
from bench.harness import SMOLLM2, out_dir, pyplot, random_model, save, save_png
from kvflash.config import EngineConfig, ModelConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.models.llama import LlamaForCausalLM
from kvflash.models.loader import LoadedModel
from kvflash.serve.scheduler import Scheduler

TIMED = ("_admit", "_shares_busy_prefix", "_make_room", "_start", "_round")
"""Scheduler methods timed, in the table's order."""

SMALL = ModelConfig(
    arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4,
    n_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position=1 << 20,
)  # fmt: skip
"""The CPU's model: SmolLM2's vocabulary, two small layers."""


def cpu_model() -> LoadedModel:
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMALL).eval()
    return LoadedModel(model, None, SMALL, Path("random"), torch.float32, torch.device("cpu"))


@contextmanager
def timed(spent: collections.Counter) -> Iterator[None]:
    """Adds each TIMED method's seconds to `spent` while the block runs."""
    originals = {name: getattr(Scheduler, name) for name in TIMED}

    def wrap(name: str, fn: Callable) -> Callable:
        def timer(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0

        return timer

    for name, fn in originals.items():
        setattr(Scheduler, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(Scheduler, name, fn)


def run(lm: LoadedModel, n: int, doc_tokens: int) -> dict:
    """N jobs over one document at once, 2 tokens each: first-token times and seconds per method."""
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(n)
    doc = torch.randint(0, vocab, (doc_tokens,), generator=gen).tolist()
    prompts = [doc + torch.randint(0, vocab, (16 + i % 7,), generator=gen).tolist() for i in range(n)]
    res = ResidencyConfig(chunk_tokens=64, policy="full")
    eng = Engine(lm, EngineConfig(pool_tokens=doc_tokens * 2 + n * 256, residency=res))
    sched = Scheduler(eng, None, frozenset(), max_batch=n)
    spent: collections.Counter = collections.Counter()
    try:
        with timed(spent):
            row, _ = turn(sched, prompts, 2)
    finally:
        sched.close()
    return {"n": n, "ttft_p50_s": row["ttft_p50_s"], "ttft_max_s": row["ttft_max_s"], **dict(spent)}


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ns = [str(r["n"]) for r in rows]
    bottom = [0.0] * len(rows)
    for name, label in (("_shares_busy_prefix", "busy-prefix checks"), ("_make_room", "making room"),
                        ("_start", "starting (sharing)")):  # fmt: skip
        vals = [r.get(name, 0.0) for r in rows]
        ax.bar(ns, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    rest = [r.get("_admit", 0.0) - b for r, b in zip(rows, bottom, strict=True)]
    ax.bar(ns, rest, bottom=bottom, label="the rest of admission")
    ax.set_xlabel("conversations over one document")
    ax.set_ylabel("seconds in admission")
    ax.set_title("admission before the first tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", default="8,32,64", help="comma-separated counts")
    ap.add_argument("--doc-tokens", type=int, default=32768)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default="out/shared_admission")
    args = ap.parse_args()
    lm = random_model(SMOLLM2) if args.device == "cuda" else cpu_model()
    console = Console()
    rows = []
    for n in (int(x) for x in args.conversations.split(",")):
        rows.append(run(lm, n, args.doc_tokens))
        console.print(f"N = {n}: first tokens p50 {rows[-1]['ttft_p50_s']:.2f} s")
    t = Table(title=f"N conversations over one {args.doc_tokens:,}-token document, at the scheduler")
    for col in ("N", "TTFT p50 s", "TTFT max s", *(f"{m} s" for m in TIMED)):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["n"]), f"{r['ttft_p50_s']:.2f}", f"{r['ttft_max_s']:.2f}",
                  *(f"{r.get(m, 0.0):.3f}" for m in TIMED))  # fmt: skip
    console.print(t)
    save(console, out_dir(args.out) / "shared_admission", rows, plot, args)


if __name__ == "__main__":
    main()
