"""Turn 1 and turn 2 of N conversations at the scheduler itself: no HTTP, no clients, no store.

What bench/serve_batch.py measures through a server, here without it, so that the two side by side
say what the server process adds to the engine. N jobs of --doc-tokens tokens each (windows of the
reference document at distinct offsets) go to one `Scheduler` at once (turn 1, --max-tokens
tokens each); then each conversation's next turn (its prompt, its answer and a 24-token question)
continues its live sequence (turn 2, --decode-tokens tokens each); each turn's decode steps are
timed as the scheduler reports them (`Scheduler.on_step`: median, 90th percentile, and the share
spent waiting for the device, the rest being the host's). Each arm runs fresh documents on the same
engine, in the order given:

- `quiet`: nothing else runs in the process;
- `writers`: --writers threads encode chunk-sized KV with the store's codec all along, as a
  server's store threads do while they save the snapshots of earlier answers: they share the
  scheduler thread's interpreter (one GIL);
- `... swi`: the same with the interpreter's switch interval at 0.5 ms instead of 5 ms.

  python -m bench.engine_turns --out out/engine_turns
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from rich.console import Console
from rich.table import Table

from bench.document import reference_text
from bench.harness import out_dir, progress_bar, pyplot, require_cuda, run_meta, save_png, write_json
from kvflash.config import EngineConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.engine.pool import chunk_shape
from kvflash.models.loader import load_model
from kvflash.serve.job import Job
from kvflash.serve.scheduler import Scheduler, StepTime
from kvflash.storage.codec import Codec, encode

ARMS = {
    "quiet": (False, None),
    "writers": (True, None),
    "writers, swi": (True, 0.0005),
    "quiet, swi": (False, 0.0005),
}
"""Arm -> (writer threads run, switch interval or None for the interpreter's default)."""


def turn(sched: Scheduler, prompts: list[list[int]], tokens: int) -> tuple[dict, list[list[int]]]:
    """Every prompt at once, answers of exactly `tokens` tokens: wall, TTFT p50 and max, the
    answers."""
    t0 = time.perf_counter()
    first: dict[int, float] = {}
    outs: dict[int, list[int]] = {}
    lock, done = threading.Lock(), threading.Event()
    failed: list[str] = []

    def job(i: int) -> Job:
        def on_token(_: int) -> bool:
            first.setdefault(i, time.perf_counter() - t0)
            return False

        def on_done(out: list[int], *_) -> None:
            with lock:
                outs[i] = list(out)
                if len(outs) == len(prompts):
                    done.set()

        def on_error(e: BaseException) -> None:
            failed.append(f"{type(e).__name__}: {e}")
            done.set()

        return Job(prompts[i], tokens, Sampling(), on_token, on_done, on_error, min_tokens=tokens)

    steps: list[StepTime] = []
    sched.on_step = steps.append
    for i in range(len(prompts)):
        sched.submit(job(i))
    if not done.wait(600) or failed:
        raise SystemExit(f"a job failed: {failed[0]}" if failed else "the turn did not end within 600 s")
    wall = time.perf_counter() - t0
    sched.on_step = None
    ttfts = sorted(first.values())
    row = {"wall_s": wall, "ttft_p50_s": statistics.median(ttfts), "ttft_max_s": ttfts[-1]}
    return row | decode_steps([s for s in steps if s.kind == "decode"]), [
        outs[i] for i in range(len(prompts))
    ]


def decode_steps(steps: list[StepTime]) -> dict:
    """The turn's decode steps: their median and 90th percentile in ms, and the share of their time
    the scheduler waited for the device (the rest is the host's)."""
    if not steps:
        return {"decode_steps": 0}
    ms = sorted(1e3 * s.seconds for s in steps)
    total = sum(s.seconds for s in steps)
    return {"decode_steps": len(ms), "decode_step_p50_ms": statistics.median(ms),
            "decode_step_p90_ms": ms[int(0.9 * (len(ms) - 1))],
            "decode_wait_share": sum(s.waited for s in steps) / total if total else None}  # fmt: skip


class Writers:
    """Threads that encode a chunk's KV with the store's lossless codec, over and over, until stopped."""

    def __init__(self, n: int, chunk_shape: tuple[int, ...]):
        self._stop = threading.Event()
        self._kv = torch.randn(chunk_shape).to(torch.bfloat16)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            encode(self._kv, Codec.LOSSLESS)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--doc-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length of turn 1")
    ap.add_argument("--decode-tokens", type=int, default=128, help="answer length of turn 2")
    ap.add_argument("--writers", type=int, default=8, help="threads of the writer arms")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a check that it runs, no figures")
    ap.add_argument("--out", default="out/engine_turns")
    args = ap.parse_args()
    if args.device == "cuda":
        require_cuda("engine_turns", "the scheduler's turns on the GPU")
    out = out_dir(args.out)
    n, length = args.conversations, args.doc_tokens
    lm = load_model(args.model, device=args.device)
    tok = lm.tokenizer
    ids = tok.encode_plain(reference_text(455_000, tok))
    stride = (len(ids) - length) // (n * len(args.arms))
    question = tok.encode_plain(" And who is mentioned most often in the text above? Answer briefly.")[:24]
    engine = Engine(lm, EngineConfig(pool_tokens=2 * n * (length + 256) * len(args.arms)))
    sched = Scheduler(engine, None, tok.eos_ids, max_batch=n)
    shape = chunk_shape(lm.config, engine.cfg.residency.chunk_tokens)
    rows = []
    default_swi = sys.getswitchinterval()
    try:
        turn(sched, [ids[:100]], 4)  # the first request of a process
        with progress_bar() as progress:
            task = progress.add_task("arms", total=len(args.arms))
            for k, arm in enumerate(args.arms):
                load, swi = ARMS[arm]
                sys.setswitchinterval(swi or default_swi)
                prompts = [ids[(k * n + i) * stride :][:length] for i in range(n)]
                writers = Writers(args.writers if load else 0, shape)
                try:
                    first, answers = turn(sched, prompts, args.max_tokens)
                    nxt = [p + a + question for p, a in zip(prompts, answers, strict=True)]
                    second, _ = turn(sched, nxt, args.decode_tokens)
                finally:
                    writers.stop()
                second["tok_s"] = n * args.decode_tokens / second["wall_s"]
                rows.append({"arm": arm, "turn1": first, "turn2": second})
                progress.advance(task)
    finally:
        sys.setswitchinterval(default_swi)
        sched.close()
    report(args, rows)
    write_json(out / "engine_turns.json", {"meta": run_meta(args=vars(args)), "rows": rows})
    plot(rows, out / "engine_turns.png")


def report(args, rows: list[dict]) -> None:
    t = Table(
        title=f"{args.conversations} conversations at the scheduler, {args.doc_tokens:,}-token documents"
    )
    for col in (
        "arm",
        "turn 1 wall s",
        "turn 1 TTFT p50 s",
        "turn 2 wall s",
        "turn 2 TTFT p50 s",
        "turn 2 tok/s",
        "decode step ms p50 / p90 (device wait), turn 1",
        "turn 2",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        a, b = r["turn1"], r["turn2"]
        t.add_row(r["arm"], f"{a['wall_s']:.2f}", f"{a['ttft_p50_s']:.2f}", f"{b['wall_s']:.2f}",
                  f"{b['ttft_p50_s']:.3f}", f"{b['tok_s']:,.0f}", step_cell(a), step_cell(b))  # fmt: skip
    Console().print(t)


def step_cell(turn: dict) -> str:
    if not turn.get("decode_steps"):
        return "-"
    p50, p90, wait = turn["decode_step_p50_ms"], turn["decode_step_p90_ms"], turn["decode_wait_share"]
    return f"{p50:.2f} / {p90:.2f} ({wait:.0%})"


def plot(rows: list[dict], path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["turn1"]["ttft_p50_s"] for r in rows], 0.4, label="turn 1 TTFT p50")
    ax.bar([i + 0.2 for i in x], [r["turn2"]["ttft_p50_s"] for r in rows], 0.4, label="turn 2 TTFT p50")
    ax.set_xticks(list(x), [r["arm"] for r in rows])
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
