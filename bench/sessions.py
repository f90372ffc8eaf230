"""Turn-2 vs turn-1 time to first token over long documents, each turn in a fresh `kvflash ask` process.

Turn 1 prefills the document cold and snapshots it; turn 2 asks another question in a new process and
restores the document from disk (lazily when its KV exceeds the pool budget). Prints one table and
writes JSON (and a PNG bar chart) to --out.

  python -m bench.sessions --lengths 4096,8192 --pool-tokens 8192 --out out/sessions
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.harness import out_dir, pyplot, save_png, write_json
from kvflash.eval.haystack import filler_sentences


def make_document(n_tokens: int, count, seed: int = 0) -> str:
    """Filler prose of about n_tokens tokens (by the model's tokenizer)."""
    sents = filler_sentences(random.Random(seed))
    parts: list[str] = []
    while True:
        parts.extend(next(sents) for _ in range(200))
        if count(" ".join(parts)) >= n_tokens:
            break
    lo, hi = 1, len(parts)
    while lo < hi:  # the longest prefix of sentences within n_tokens
        mid = (lo + hi + 1) // 2
        if count(" ".join(parts[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(parts[:lo])


def ask(doc: Path, question: str, store: Path, args, env, positions: str) -> dict:
    cmd = [sys.executable, "-m", "kvflash.cli.app", "ask", str(doc), question, "--store", str(store),
           "--pool-tokens", str(args.pool_tokens), "-n", str(args.max_tokens), "--json"]  # fmt: skip
    if positions == "absolute":
        cmd.append("--absolute-positions")
    if args.decode_processes:
        cmd += ["--decode-processes", str(args.decode_processes)]
    if args.model:
        cmd += ["--model", args.model]
    if args.device:
        cmd += ["--device", args.device]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"kvflash ask failed: {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout)
    out["process_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--decode-processes", type=int, default=0, help="passed to ask (0: the store's threads)")
    ap.add_argument("--out", default="out/sessions")
    ap.add_argument(
        "--positions", default="cache", help="cache, absolute, or both as cache,absolute: arms per length"
    )
    args = ap.parse_args()
    arms = args.positions.split(",")
    if not arms or any(a not in ("cache", "absolute") for a in arms):
        raise SystemExit(f"--positions takes cache, absolute or cache,absolute, not {args.positions!r}")
    out = out_dir(args.out)

    from kvflash.models.loader import load_model

    tok = load_model(args.model, device="cpu", need_tokenizer=True).tokenizer
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            doc = Path(tmp) / f"doc{n}.txt"
            doc.write_text(make_document(n, lambda s: len(tok.encode_plain(s))))
            env = dict(os.environ)
            for arm in arms:  # side by side: each arm its own store, turn 1 then turn 2
                store = Path(tmp) / f"store-{arm}"
                t1 = ask(doc, "What is the first sentence of the document about?", store, args, env, arm)
                t2 = ask(doc, "Who is mentioned most often in the document?", store, args, env, arm)
                row = {"doc_tokens": n, "pool_tokens": args.pool_tokens, "positions": arm, "turn1": t1,
                       "turn2": t2, "ratio": t2["ttft_s"] / t1["ttft_s"]}  # fmt: skip
                rows.append(row)
                Console(stderr=True).print(
                    f"{n} tokens, {arm} positions: turn1 {t1['ttft_s']:.2f}s turn2 {t2['ttft_s']:.2f}s"
                )
    write_json(out / "sessions.json", rows)
    table = Table(title=f"turn-2 vs turn-1 TTFT (pool {args.pool_tokens} tokens)")
    for col in ("doc tokens", "positions", "turn 1 TTFT s", "turn 2 TTFT s", "turn 2 source", "restored",
                "prefilled", "disk MiB", "turn2/turn1"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        t1, t2 = r["turn1"], r["turn2"]
        table.add_row(str(r["doc_tokens"]), r["positions"], f"{t1['ttft_s']:.2f}", f"{t2['ttft_s']:.2f}",
                      t2["source"], str(t2["restored_tokens"]), str(t2["prefilled_tokens"]),
                      f"{t2['bytes_moved'].get('disk', 0) / 2**20:.0f}", f"{r['ratio']:.3f}")  # fmt: skip
    Console().print(table)
    _plot(rows, out / "sessions.png")


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    both = len({r["positions"] for r in rows}) > 1
    labels = [f"{r['doc_tokens'] // 1024}K" + (f"\n{r['positions']}" if both else "") for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([i - 0.2 for i in x], [r["turn1"]["ttft_s"] for r in rows], 0.4, label="turn 1 (cold)")
    ax.bar([i + 0.2 for i in x], [r["turn2"]["ttft_s"] for r in rows], 0.4, label="turn 2 (restored)")
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
