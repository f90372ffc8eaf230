"""A user's two turns over a long real document: `kvflash ask` as processes, against HF transformers.

The document is the first --tokens tokens of Python's language reference (`document.py`). Turn 1 is
a `kvflash ask` process over a new snapshot store (cold prefill, then the snapshot); turn 2 is a new
`kvflash ask` process with another question, restoring from that store (lazily; --scout-reads N
has its question's scouts read the N disk-only chunks their summaries rank highest). Each process's
wall time is timed from outside; TTFT, where the KV came from and the bytes moved per tier come from
its `--json` stats. The peer, in the same run after the processes, is HF transformers on the same
prompt ids with the same weights (the whole prompt in one forward, KV on the GPU): its TTFT counts
the tokenisation of the prompt as kvflash's does. --rounds repeats both turns, each round over a new
store. Prints one table, writes JSON and a PNG.

  python -m bench.ask --tokens 131072 --pool-tokens 8192 --out out/ask
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.document import reference_text
from bench.harness import out_dir, pyplot, require_cuda, save, save_png
from bench.hf import hf_llama, hf_prefill_s
from kvflash.models.fetch import default_model_path
from kvflash.models.loader import load_model
from kvflash.serve.prompt import encode_messages
from kvflash.serve.session import Document, system_message

QUESTIONS = (
    "What does the nonlocal statement do?",
    "How does a for loop's else clause behave?",
)


def ask_process(doc: Path, question: str, store: Path, args, extra: tuple[str, ...] = ()) -> dict:
    """One `kvflash ask` process: its wall time and its stats."""
    cmd = [sys.executable, "-m", "kvflash.cli.app", "ask", str(doc), question, "--store", str(store),
           "--pool-tokens", str(args.pool_tokens), "-n", str(args.max_tokens), "--json", *extra]  # fmt: skip
    if args.model:
        cmd += ["--model", args.model]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"kvflash ask failed:\n{out.stderr[-2000:]}")
    warned = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    for line in warned:  # a snapshot that could not be saved, a store that went cold: say so
        print(line, file=sys.stderr)
    return {"wall_s": wall, "warnings": warned, **json.loads(out.stdout.strip().splitlines()[-1])}


def hf_ttft(lm, model, doc: Path, question: str) -> tuple[float, float, int]:
    """(TTFT with the prompt's tokenisation, the forward alone, prompt tokens) for HF."""
    t0 = time.perf_counter()
    messages = [system_message([Document(doc.name, doc.read_text())]), {"role": "user", "content": question}]
    ids = encode_messages(lm.tokenizer, messages)
    tokenise = time.perf_counter() - t0
    forward, _ = hf_prefill_s(model, ids)
    return tokenise + forward, forward, len(ids)


def table(rows: list[dict]) -> Table:
    t = Table(title=f"`kvflash ask` processes against HF transformers, {torch.cuda.get_device_name()}")
    for col in ("round", "turn", "wall s", "TTFT s", "source", "host->GPU GB", "disk MB",
                "HF TTFT s (forward)"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        for turn in ("cold", "turn2"):
            s = r[turn]
            t.add_row(
                str(r["round"]), turn, f"{s['wall_s']:.2f}", f"{s['ttft_s']:.3f}", s["source"],
                f"{s['bytes_moved'].get('host_to_gpu', 0) / 1e9:.2f}",
                f"{s['bytes_moved'].get('disk', 0) / 1e6:.0f}",
                f"{r['hf_ttft_s']:.3f} ({r['hf_forward_s']:.3f})" if turn == "cold" else "",
            )  # fmt: skip
    return t


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    med = {k: statistics.median(r[k] for r in rows) for k in ("hf_ttft_s",)}
    bars = {
        "kvflash ask, turn 1 (cold)": statistics.median(r["cold"]["ttft_s"] for r in rows),
        "kvflash ask, turn 2 (new process)": statistics.median(r["turn2"]["ttft_s"] for r in rows),
        "HF transformers (re-reads)": med["hf_ttft_s"],
    }
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(bars), list(bars.values()), color=["C0", "C2", "0.5"])
    for i, v in enumerate(bars.values()):
        ax.text(v, i, f" {v:.2f} s", va="center")
    ax.set_xlabel("time to first token, s")
    ax.set_title(f"{rows[0]['prompt_tokens']:,}-token document, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the default model)")
    ap.add_argument("--scout-reads", type=int, default=0, help="turn 2's `kvflash ask --scout-reads`")
    ap.add_argument("--out", default="out/ask")
    args = ap.parse_args()
    require_cuda("ask", "the GPU path")
    out = out_dir(args.out)
    console = Console()
    lm = load_model(Path(args.model) if args.model else default_model_path(fetch=False))
    doc = out / "reference.txt"
    doc.write_text(reference_text(args.tokens, lm.tokenizer))
    rows = []
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as store:
            console.print(f"round {r}: turn 1 (cold) ...")
            cold = ask_process(doc, QUESTIONS[0], Path(store), args)
            console.print(f"round {r}: turn 2 (a new process) ...")
            reads = ("--scout-reads", str(args.scout_reads))
            turn2 = ask_process(doc, QUESTIONS[1], Path(store), args, reads)
        rows.append({"round": r, "cold": cold, "turn2": turn2})
    hf = hf_llama(lm)
    hf_prefill_s(hf, list(range(256)))  # its first forward pays cuBLAS and kernel selection
    for row in rows:
        row["hf_ttft_s"], row["hf_forward_s"], row["prompt_tokens"] = hf_ttft(lm, hf, doc, QUESTIONS[0])
    console.print(table(rows))
    save(console, out / "ask", rows, plot, args)


if __name__ == "__main__":
    main()
