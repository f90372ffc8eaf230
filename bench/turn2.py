"""Turn 2 of a long-document `kvflash ask`, in-process and phase by phase, over a store that turn 1
would have left: where a restored turn's time goes before its first token.

The model is the default one (its tokenizer, config and fingerprint); the stored KV is synthetic
(random bf16 KV and summaries of the model's shape, so a chunk's bytes and compression are what a
restore reads), written as turn 1 of `kvflash ask` writes it: the document's chunks under the
approximate fingerprint, with the snapshot meta a session keeps. The store is made once under
--dir and reused. Each round asks a new question (so no round restores another's chunks),
profiles the turn, and removes the snapshot the turn saved. Phases are timed by wrapping the
functions a turn calls; `counts` are calls of the functions a turn repeats per chunk. As `kvflash
ask` does, each round builds the session and then warms the engine, while the session reads the
stored documents' ids and summaries on its thread ("summaries ahead": beside the warm-up, outside
the turn's wall unless it outlasts the warm-up, as it does on a CPU, where there is none).

    python -m bench.turn2 --tokens 131072 --pool-tokens 8192 --out out/turn2
    python -m bench.turn2 --shape llama-8b --hf --rounds 2 --out out/turn2-8b

`--shape llama-8b` runs the same turn on a model of Llama-3-8B's shape with random weights (the
default model's tokenizer: the prompt is the same text); `--hf` times, in the same run, the peer's
cold prefill of turn 2's whole prompt (HF transformers, SDPA, the whole KV on the GPU), which is what
a user without kvflash waits for before turn 2's first token.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.document import reference_text
from bench.harness import LLAMA_8B, random_model, save
from bench.hf import hf_llama, hf_prefill_s
from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.models.loader import load_model
from kvflash.serve.prompt import content_start, encode_messages
from kvflash.serve.session import Document, Session, system_message
from kvflash.serve.snapshots import APPROX_SUFFIX
from kvflash.storage import ROOT_HASH, ChunkBlob, SnapshotStore

AHEAD = "summaries ahead"
PHASES = {
    AHEAD: ("kvflash.serve.session", "Session", "_stored_document_ids"),
    "lookup": ("kvflash.serve.snapshots", "KVSnapshots", "lookup"),
    "restore": ("kvflash.serve.snapshots", "KVSnapshots", "restore"),
    "prefill": ("kvflash.engine.engine", "Engine", "prefill"),
    "chunk reads": ("kvflash.storage.store", "SnapshotStore", "read_chunks_parallel"),
    "scoring": ("kvflash.engine.paged_kv", "PagedKV", "end"),
    "save": ("kvflash.serve.session", "Session", "save"),
}
"""Phase name -> (module, class, method) whose calls it sums (nested: chunk reads and scoring run
inside the prefill)."""
COUNTED = ("chain_hash", "openssl_sha256", "exists", "exists_all", "stat", "chunk_rows", "intact")


def stored_turn1(store: SnapshotStore, engine: Engine, doc: Document, question: str) -> None:
    """Writes what turn 1 of `kvflash ask` leaves for this document: its prompt's full chunks (the
    document's, approximate: its prefill evicted) and a snapshot with the meta a session saves."""
    lm, res = engine.lm, engine.cfg.residency
    chunk, blocks, tok = res.chunk_tokens, res.summary_blocks, lm.tokenizer
    messages = [system_message([doc])]
    user = {"role": "user", "content": question}
    docs = tok.encode_plain(messages[0]["content"])
    ids = encode_messages(tok, messages + [user], known={0: docs})
    start = content_start(tok, messages)
    cfg = lm.config
    fp = engine.fingerprint + APPROX_SUFFIX
    g = torch.Generator().manual_seed(0)
    shape = (cfg.n_layers, 2, cfg.n_kv_heads, chunk, cfg.head_dim)
    kvs = [torch.randn(shape, generator=g).to(engine.kv_dtype) for _ in range(8)]
    blobs, parent = [], ROOT_HASH
    n = len(ids) // chunk
    for i in range(n):
        summary = torch.randn((cfg.n_layers, cfg.n_kv_heads, blocks, cfg.head_dim), generator=g)
        blob = ChunkBlob.build(fp, i, parent, ids[i * chunk : (i + 1) * chunk], summary, kvs[i % len(kvs)])
        blobs.append(blob)
        parent = blob.chain_hash
    plain = Session(engine, [doc])  # its label and documents' hash, as turn 1's session had them
    meta = {"docs": plain.docs_hash, "doc_span": [start, start + len(docs)], "messages": [user],
            "tail": ids[n * chunk :]}  # fmt: skip
    sid = store.put_snapshot(plain.label, fp, blobs, meta)
    store.pin(sid)  # a round's own save replaces the label's unpinned snapshots


class Phases:
    """Seconds and calls of each of PHASES, by wrapping its method for the block's duration."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.calls = dict.fromkeys(PHASES, 0)

    @contextmanager
    def timing(self, names=PHASES):
        """Wraps the methods of the phases named (all by default) for the block's duration."""
        import importlib

        saved = []
        for name in names:
            mod, cls, meth = PHASES[name]
            owner = getattr(importlib.import_module(mod), cls)
            fn = getattr(owner, meth)
            saved.append((owner, meth, fn))
            setattr(owner, meth, self._wrap(name, fn))
        try:
            yield self
        finally:
            for owner, meth, fn in saved:
                setattr(owner, meth, fn)

    def _wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed


def counts(prof: cProfile.Profile) -> dict[str, int]:
    """Calls of the COUNTED functions (by name, of any module; built-ins too) in a profile."""
    out = dict.fromkeys(COUNTED, 0)
    for (_, _, fn), (_, ncalls, *_) in pstats.Stats(prof).stats.items():
        name = fn.removeprefix("<built-in method ").removesuffix(">").rsplit(".", 1)[-1]
        if name in out:
            out[name] += ncalls
    return out


def prompt_ids(tok, doc: Document, question: str) -> list[int]:
    """Turn 2's whole prompt, as a session encodes it: the document as system message, the question."""
    return encode_messages(tok, [system_message([doc]), {"role": "user", "content": question}])


def turn2(engine: Engine, store: SnapshotStore, doc: Document, question: str, max_tokens: int) -> dict:
    """One turn 2 in a new session (as a new `kvflash ask` process has): phases, counts, stats."""
    prof, ph = cProfile.Profile(), Phases()
    ahead, in_turn = [AHEAD], [p for p in PHASES if p != AHEAD]
    with ph.timing(ahead):
        sess = Session(engine, [doc], store, prefetch=False)  # as `kvflash ask` opens it,
        engine.warm_up()  # then warms the engine (its prefills are not the turn's) while the
        try:  # session reads the stored documents on its thread
            with ph.timing(in_turn):
                t0 = time.perf_counter()
                prof.enable()
                _, stats = sess.ask(question, max_tokens=max_tokens)
                prof.disable()
                wall = time.perf_counter() - t0
        finally:
            sess.close()
    if stats.snapshot_id:
        store.rm(stats.snapshot_id)
    return {
        "wall_s": wall,
        "ttft_s": stats.ttft_s,
        "source": stats.source,
        "restored_tokens": stats.restored_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "disk_mb": stats.bytes_moved.get("disk", 0) / 1e6,
        "phases_s": ph.seconds,
        "phase_calls": ph.calls,
        "counts": counts(prof),
    }


def table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    t.add_column("phase")
    for r in rows:
        t.add_column(f"round {r['round']}", justify="right")
    t.add_column("median", justify="right")
    lines = [("TTFT s", lambda r: r["ttft_s"]), ("turn wall s", lambda r: r["wall_s"])]
    lines += [(f"{p} s", lambda r, p=p: r["phases_s"][p]) for p in PHASES]
    lines += [("disk MB", lambda r: r["disk_mb"]), ("chunk reads MB/s", read_rate)]
    if "hf_prefill_s" in rows[0]:
        lines += [("HF cold prefill s", lambda r: r["hf_prefill_s"]),
                  ("TTFT / HF cold prefill", lambda r: r["ttft_s"] / r["hf_prefill_s"])]  # fmt: skip
    for name, get in lines:
        vals = [get(r) for r in rows]
        t.add_row(name, *(f"{v:.3f}" for v in vals), f"{statistics.median(vals):.3f}")
    for name in COUNTED:
        vals = [r["counts"][name] for r in rows]
        t.add_row(f"calls of {name}", *(str(v) for v in vals), str(statistics.median(vals)))
    return t


def read_rate(r: dict) -> float:
    s = r["phases_s"]["chunk reads"]
    return r["disk_mb"] / s if s else 0.0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = {p: statistics.median(r["phases_s"][p] for r in rows) for p in PHASES}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(list(med), list(med.values()), color="C0")
    for i, v in enumerate(med.values()):
        ax.text(v, i, f" {v:.3f} s", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median of rounds; chunk reads and scoring lie within the prefill)")
    ttft = statistics.median(r["ttft_s"] for r in rows)
    title = f"turn 2 at {rows[0]['restored_tokens']:,} restored tokens: TTFT {ttft:.2f} s"
    if "hf_prefill_s" in rows[0]:
        title += f" (HF cold prefill {rows[0]['hf_prefill_s']:.2f} s)"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", help="the model's and the KV's dtype")
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the default model)")
    ap.add_argument(
        "--shape",
        choices=["model", "llama-8b"],
        default="model",
        help="llama-8b: Llama-3-8B's shape, random weights, --model's tokenizer (CUDA, bf16)",
    )
    ap.add_argument("--hf", action="store_true", help="time HF transformers' cold prefill of the same prompt")
    ap.add_argument("--dir", default="out/turn2-store", help="where the store is made, once")
    ap.add_argument("--out", default="out/turn2")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    lm = load_model(args.model, dtype=args.dtype)
    if args.shape == "llama-8b":
        lm = replace(random_model(LLAMA_8B), tokenizer=lm.tokenizer)
    engine = Engine(lm, EngineConfig(pool_tokens=args.pool_tokens, residency=ResidencyConfig()), warm=False)
    doc = Document("reference.txt", reference_text(args.tokens, lm.tokenizer))
    store_dir = Path(args.dir) / f"{args.shape}-{args.tokens}-{args.dtype}"
    fresh = not store_dir.exists()
    with SnapshotStore(store_dir) as store:
        if fresh:
            console.print(f"writing turn 1's store under {store_dir} ...")
            stored_turn1(store, engine, doc, "What does the nonlocal statement do?")
        rows = []
        for r in range(args.rounds):
            question = f"Question {r}: how does a for loop's else clause behave?"
            rows.append({"round": r, **turn2(engine, store, doc, question, args.max_tokens)})
    if args.hf:
        del engine
        torch.cuda.empty_cache()
        ids = prompt_ids(lm.tokenizer, doc, question)
        model = hf_llama(lm)
        hf_prefill_s(model, ids[:256])  # its first forward pays cuBLAS and kernel selection
        hf_s = [hf_prefill_s(model, ids)[0] for _ in range(2)]
        for r in rows:
            r["hf_prefill_s"], r["hf_prompt_tokens"] = min(hf_s), len(ids)
    title = f"turn 2 of `kvflash ask` in-process, {lm.device}, {args.tokens:,}-token document"
    console.print(table(rows, title))
    save(console, out / "turn2", rows, plot, args)


if __name__ == "__main__":
    main()
