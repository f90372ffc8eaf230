"""Batched decode (`Engine.decode_batch`, what the scheduler runs) against the same sequences decoded
one at a time, side by side, alternating.

B sequences, each prefilled with --prompt-tokens random ids, decode --steps steps teacher-forced:
once as B single-sequence forwards per step, once as one forward of B. Tokens per second of each, per
B; rounds alternate the two. Prints one table, writes JSON and a PNG.

  python bench/batch.py --batches 1 2 4 8 --out out/batch
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflash.config import EngineConfig
from kvflash.engine import Engine
from kvflash.models.loader import load_model


def rate(eng: Engine, seqs, steps: int, together: bool) -> float:
    tokens = [1] * len(seqs)
    sync = torch.cuda.synchronize if eng.lm.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        if together:
            eng.decode_batch(seqs, tokens)
        else:
            for kv, tok in zip(seqs, tokens, strict=True):
                eng.decode_batch([kv], [tok])
    sync()
    return steps * len(seqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/batch")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_model(args.model, device=args.device)
    per_seq = args.prompt_tokens + 2 * args.rounds * args.steps + 64
    eng = Engine(lm, EngineConfig(pool_tokens=max(args.batches) * (per_seq + 64)))
    rows = []
    with Progress() as progress:
        task = progress.add_task("batches", total=len(args.batches))
        for b in args.batches:
            seqs = [eng.new_sequence(per_seq + 64) for _ in range(b)]
            for i, kv in enumerate(seqs):
                gen = torch.Generator().manual_seed(i)
                eng.prefill(
                    kv, torch.randint(0, lm.config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
                )
            alone, together = [], []
            for _ in range(args.rounds):
                alone.append(rate(eng, seqs, args.steps, together=False))
                together.append(rate(eng, seqs, args.steps, together=True))
            med = statistics.median
            rows.append({"batch": b, "alone_tok_s": med(alone), "together_tok_s": med(together),
                         "alone_runs": alone, "together_runs": together})  # fmt: skip
            for kv in seqs:
                kv.free()
            progress.advance(task)
    table = Table(title=f"decode tokens / s on {lm.device}, {args.prompt_tokens}-token prompts")
    for col in ("batch", "one at a time", "batched", "batched / one at a time"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['alone_tok_s']:.1f}", f"{r['together_tok_s']:.1f}",
                      f"{r['together_tok_s'] / r['alone_tok_s']:.2f}x")  # fmt: skip
    Console().print(table)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": str(lm.device), "torch": torch.__version__,
            "python": platform.python_version(), "args": vars(args)}  # fmt: skip
    (out / "batch.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, out / "batch.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["alone_tok_s"] for r in rows], "o-", label="one at a time")
    ax.plot(xs, [r["together_tok_s"] for r in rows], "o-", label="batched")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences")
    ax.set_ylabel("decode tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
