"""`make demo`: two questions about demo/harbor_chronicle.txt in two `kvflash ask` processes, then
their answers and timings side by side.

Turn 1 prefills the ~8K-token document cold and snapshots its KV; turn 2, a new process, restores it
from disk and prefills only its question. Both keep POOL_TOKENS of KV resident and attend with `qk`
over it: with the whole document resident (full attention) SmolLM2-135M answers the first
question wrongly, with `qk` over a 2K pool it answers both (docs/BENCHMARKS.md, "First
impressions", has the other facts the document holds and how a restored turn answers each).

  python demo/run.py [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

DOC = Path(__file__).with_name("harbor_chronicle.txt")
QUESTIONS = (
    "Who built the lighthouse of Port Elden, and when?",
    "How many arches does the stone bridge over the river Fenn have?",
)
POOL_TOKENS = 2048
MAX_TOKENS = 48


def ask(question: str, store: Path, kvflash: list[str]) -> dict:
    """One `kvflash ask --json` process; its answer and stats."""
    cmd = [*kvflash, "ask", str(DOC), question, "--store", str(store), "-n", str(MAX_TOKENS),
           "--pool-tokens", str(POOL_TOKENS), "--policy", "qk", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.returncode)
    return json.loads(proc.stdout)


def run(store: Path, kvflash: list[str], console: Console) -> list[dict]:
    shutil.rmtree(store, ignore_errors=True)
    turns = []
    for i, (question, what) in enumerate(zip(QUESTIONS, ("cold prefill", "restored from disk"), strict=True)):
        console.print(f"[bold]== turn {i + 1} ({what}, a new process):[/] {question}")
        turns.append(ask(question, store, kvflash))
        console.print(turns[-1]["answer"].strip(), highlight=False)
    return turns


def table(turns: list[dict]) -> Table:
    t = Table(title=f"{DOC.name}, qk over a {POOL_TOKENS:,}-token pool", show_lines=True)
    t.add_column("turn")
    t.add_column("answer", ratio=1)
    for col in ("TTFT", "KV from", "decode"):
        t.add_column(col, justify="right", no_wrap=True)
    for i, r in enumerate(turns):
        answer = r["answer"].strip()
        t.add_row(str(i + 1), answer, f"{r['ttft_s']:.2f} s", r["source"], f"{r['decode_tok_s']:.1f} tok/s")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=".demo-store", help="snapshot store (emptied first)")
    args = ap.parse_args()
    console = Console()
    turns = run(Path(args.store), [sys.executable, "-m", "kvflash.cli.app"], console)
    console.print(table(turns))


if __name__ == "__main__":
    main()
