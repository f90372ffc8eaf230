"""`kvflash bench`: what a long-document session costs on this machine, cold and restored from disk.

For each document length, a generated document (filler prose with a passcode at mid-depth) is asked
about twice, each time in a fresh engine and session over one new snapshot store, as two `kvflash
ask` processes would: turn 1 prefills the document cold and snapshots it; turn 2 finds nothing in
memory and restores the document from disk (lazily when its KV exceeds the pool). The ratio of the
two times to first token is what the store saves; both answers are checked for the passcode.
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.table import Table

from kvflash.config import EngineConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.eval.haystack import PASSCODE
from kvflash.eval.niah import make_haystack
from kvflash.models.loader import LoadedModel
from kvflash.serve.session import Document, Session
from kvflash.storage import SnapshotStore

TURNS = ("cold", "restored")
"""Each row's keys for its two turns, in the order they run."""


@dataclass(frozen=True)
class BenchConfig:
    lengths: tuple[int, ...] = (4096, 16384)
    """Document lengths in tokens (of the model's tokenizer)."""
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(pool_tokens=16384))
    """The engine each turn builds afresh."""
    max_tokens: int = 16
    seed: int = 0


def run(
    lm: LoadedModel, cfg: BenchConfig, on_prefill: Callable[[str, int, int], None] | None = None
) -> list[dict]:
    """One row per length: each turn's TurnStats as a dict plus its answer and whether it holds the
    passcode, and the turn-2 / turn-1 TTFT ratio. on_prefill(label, done, total) reports progress."""
    rows = []
    for n in cfg.lengths:
        hay = make_haystack(n, 0.5, cfg.seed, lambda s: len(lm.tokenizer.encode_plain(s)), PASSCODE)
        doc = Document(f"haystack-{n}.txt", hay.document)
        turns = {}
        with tempfile.TemporaryDirectory(prefix="kvflash-bench-") as tmp:
            store = SnapshotStore(Path(tmp))
            try:
                for turn in TURNS:
                    label = f"{n:,} tokens, {turn}"
                    report = (lambda d, t, label=label: on_prefill(label, d, t)) if on_prefill else None
                    turns[turn] = _turn(lm, cfg, doc, hay.question, hay.value, store, report)
            finally:
                store.close()
        rows.append(
            {
                "doc_tokens": n,
                "pool_tokens": cfg.engine.pool_tokens,
                **turns,
                "ttft_ratio": turns["restored"]["ttft_s"] / turns["cold"]["ttft_s"],
            }
        )
    return rows


def _turn(
    lm: LoadedModel,
    cfg: BenchConfig,
    doc: Document,
    question: str,
    value: str,
    store: SnapshotStore,
    on_prefill: Callable[[int, int], None] | None,
) -> dict:
    """One question in a fresh engine and session: nothing of an earlier turn is in memory, only in
    the store. The engine is freed before the next turn, so an 'auto' pool can take the GPU again."""
    engine = Engine(lm, cfg.engine)
    sess = Session(engine, [doc], store)
    try:
        text, stats = sess.ask(question, cfg.max_tokens, Sampling(), on_prefill=on_prefill)
    finally:
        sess.close()
        del sess, engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {**stats.to_dict(), "answer": text, "found": value in text}


def table(rows: list[dict], device: str) -> Table:
    pool = rows[0]["pool_tokens"] if rows else "?"
    t = Table(title=f"kvflash bench on {device}, pool {pool} tokens: time to first token, cold then restored")
    for col in ("tokens", "cold s", "restored s", "from", "ratio", "disk MiB", "tok/s", "passcode"):
        t.add_column(col, justify="right")
    for r in rows:
        cold, warm = r["cold"], r["restored"]
        t.add_row(
            f"{r['doc_tokens']:,}", f"{cold['ttft_s']:.2f}", f"{warm['ttft_s']:.2f}", warm["source"],
            f"{r['ttft_ratio']:.3f}", f"{warm['bytes_moved'].get('disk', 0) / 2**20:.1f}",
            f"{cold['decode_tok_s']:.0f}/{warm['decode_tok_s']:.0f}",
            f"{'yes' if cold['found'] else 'no'}/{'yes' if warm['found'] else 'no'}",
        )  # fmt: skip
    return t


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Both turns' time to first token per length, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.2 * len(rows) + 3, 3.5))
    ax.bar([i - 0.2 for i in x], [r["cold"]["ttft_s"] for r in rows], 0.4, label="turn 1 (cold)")
    ax.bar([i + 0.2 for i in x], [r["restored"]["ttft_s"] for r in rows], 0.4, label="turn 2 (restored)")
    ax.set_xticks(list(x), [f"{r['doc_tokens']:,}" for r in rows])
    ax.set_yscale("log")
    ax.set_xlabel("document tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"kvflash bench, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
