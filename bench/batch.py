"""Batched decode (`Engine.decode_batch`, what the scheduler runs) against the same sequences decoded
one at a time, side by side, alternating.

B sequences, each prefilled with --prompt-tokens random ids (over a pool budget of --budget-tokens
each, by default all they hold), decode --steps steps teacher-forced:
as B single-sequence forwards per step (eager), on CUDA also as B single-sequence steps replayed from
each sequence's CUDA graphs (`Engine.decode_step`, what a lone request gets) and as one forward of B
launched eagerly (`Engine.decode_batch_eager`), and as `Engine.decode_batch` (one forward of B,
replayed from the batch's CUDA graph on CUDA); `served` runs the same prompts as B requests through
the scheduler (`serve`'s engine loop, sampling and callbacks included; not over HTTP).
Tokens per second of each, per B; rounds alternate them. Prints one table, writes JSON and a PNG.

  python -m bench.batch --batches 1 2 4 8 --out out/batch
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import out_dir, progress_bar, pyplot, save_png, write_json
from kvflash.config import EngineConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling, eager_step
from kvflash.models.loader import load_model
from kvflash.serve.job import Job
from kvflash.serve.scheduler import Scheduler

MODES = {
    "alone": "one at a time",
    "graphs": "one at a time, graphs",
    "together_eager": "batched, eager",
    "together": "batched",
    "served": "served",
}
CUDA_ONLY = ("graphs", "together_eager")
"""Modes that differ from another only where CUDA graphs replay."""


def rate(eng: Engine, seqs, steps: int, mode: str) -> float:
    """Tokens per second over `steps` steps, after one untimed step (graphs for a new shape or step
    kind are captured on first use; the caller's untimed round meets most of them)."""
    sync = torch.cuda.synchronize if eng.lm.device.type == "cuda" else (lambda: None)
    steps_of = {"alone": partial(eager_step, eng.lm.model), "graphs": eng.decode_step}
    one = [steps_of[mode](kv) for kv in seqs] if mode in steps_of else []
    for i in range(steps + 1):
        if i == 1:
            sync()
            t0 = time.perf_counter()
        if mode == "together":
            eng.decode_batch(seqs, [1] * len(seqs))
        elif mode == "together_eager":
            eng.decode_batch_eager(seqs, [1] * len(seqs))
        else:
            for kv, step in zip(seqs, one, strict=True):
                step(1, len(kv.seq))
    sync()
    return steps * len(seqs) / (time.perf_counter() - t0)


def served(eng: Engine, prompts: list[list[int]], steps: int) -> float:
    """Tokens per second of the scheduler (what `serve` runs, sampling included) over a request per
    prompt, counted while all of them decode: each request ends `steps` tokens after the last one
    began, and the count runs from then to the first end. Each request's budget is the pool over
    their number."""
    stamps: list[list[float]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    done = threading.Semaphore(0)

    def job(i: int) -> Job:
        def on_token(tok: int) -> bool:  # on the scheduler's thread, one call at a time
            stamps[i].append(time.perf_counter())
            if not all(stamps):
                return False
            lo = max(s[0] for s in stamps)
            return sum(t > lo for t in stamps[i]) >= steps

        def failed(e: BaseException) -> None:
            errors.append(e)
            done.release()

        return Job(prompts[i], 1 << 20, Sampling(), on_token, lambda *_: done.release(), failed)

    sched = Scheduler(eng, None, frozenset(), max_batch=len(prompts))
    for i in range(len(prompts)):
        sched.submit(job(i))
    for _ in prompts:
        done.acquire()
    sched.close()
    if errors:
        raise errors[0]
    lo, hi = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    return sum(lo < t <= hi for s in stamps for t in s) / (hi - lo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument(
        "--budget-tokens", type=int, default=None, help="each sequence's pool budget (default: all it holds)"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/batch")
    args = ap.parse_args()
    out = out_dir(args.out)
    lm = load_model(args.model, device=args.device)
    per_seq = args.prompt_tokens + (args.rounds + 1) * len(args.modes) * (args.steps + 1) + 128
    budget = args.budget_tokens or per_seq
    eng = Engine(lm, EngineConfig(pool_tokens=max(args.batches) * budget))
    graphs = lm.device.type == "cuda" and eng.cfg.cuda_graphs
    modes = [m for m in args.modes if m not in CUDA_ONLY or graphs]
    rows = []
    with progress_bar() as progress:
        task = progress.add_task("batches", total=len(args.batches))
        for b in args.batches:
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            prompts = [
                torch.randint(0, lm.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                for g in gens
            ]
            seqs = [eng.new_sequence(budget) for _ in range(b)]
            for kv, ids in zip(seqs, prompts, strict=True):
                eng.prefill(kv, ids)
            runs: dict[str, list[float]] = {m: [] for m in modes}
            seq_modes = [m for m in modes if m != "served"]
            for m in seq_modes:  # untimed: captures every graph the timed rounds replay
                rate(eng, seqs, args.steps, m)
            for _ in range(args.rounds):
                for m in seq_modes:
                    runs[m].append(rate(eng, seqs, args.steps, m))
            for kv in seqs:
                kv.free()
            for r in range(args.rounds + 1 if "served" in modes else 0):  # the first run is untimed
                rate_served = served(eng, prompts, args.steps)
                if r:
                    runs["served"].append(rate_served)
            row = {"batch": b} | {f"{m}_tok_s": statistics.median(r) for m, r in runs.items()}
            rows.append(row | {f"{m}_runs": r for m, r in runs.items()})
            progress.advance(task)
    table = Table(
        title=f"decode tokens / s on {lm.device}, {args.prompt_tokens}-token prompts, budget {budget}"
    )
    alone = next((m for m in ("graphs", "alone") if m in modes), None)
    ratio = alone is not None and "together" in modes
    for col in ("batch", *(MODES[m] for m in modes), *([f"batched / {MODES[alone]}"] if ratio else [])):
        table.add_column(col, justify="right")
    for r in rows:
        rates = [f"{r[f'{m}_tok_s']:.1f}" for m in modes]
        table.add_row(
            str(r["batch"]), *rates, *([f"{r['together_tok_s'] / r[f'{alone}_tok_s']:.2f}x"] if ratio else [])
        )
    Console().print(table)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(lm.device), "torch": torch.__version__,
            "python": platform.python_version(), "args": vars(args)}  # fmt: skip
    write_json(out / "batch.json", {"meta": meta, "rows": rows})
    plot(rows, out / "batch.png")


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["batch"] for r in rows]
    for m, label in MODES.items():
        if f"{m}_tok_s" in rows[0]:
            ax.plot(xs, [r[f"{m}_tok_s"] for r in rows], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequences")
    ax.set_ylabel("decode tokens / s (log)")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
