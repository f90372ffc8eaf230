"""Snapshot bytes per token on disk, per KV dtype: what `--kv-dtype` saves in the store.

For each KV dtype, a fresh engine (--kv-dtype) prefills the reference document (bench/document.py,
--tokens tokens by the model's tokenizer) with a pool that holds all of it (exact KV), snapshots it
into an empty store with the given codec, and reads every chunk back against the live KV (the
lossless codec must give it bit for bit). Bytes per token count the stored chunks' tokens; a chunk
file is its header, token ids and payload: the compressed KV, and the key summary as its residual
against the keys' block means (a few bytes); the summaries file of the chain holds every chunk's
token ids and summary (docs/FORMAT.md). The f16 reference is the
model's KV in f16, uncompressed: what a llama.cpp state file holds per token.

    python -m bench.kv_bytes --tokens 4096 --out out/kv_bytes
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.document import reference_text
from bench.harness import save
from kvflash.config import DTYPES, KV_DTYPE_NAMES, EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.pool import chunk_shape
from kvflash.models.loader import LoadedModel, load_model
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import SnapshotStore
from kvflash.storage.codec import CODEC_NAMES, DEFAULT_LEVEL
from kvflash.storage.format import HEADER_SIZE


def measure(lm: LoadedModel, ids: list[int], kv_dtype: str, args) -> dict:
    """Prefills ids under kv_dtype, snapshots them into an empty store, reads the chunks back."""
    res = ResidencyConfig()
    c = res.chunk_tokens
    engine = Engine(lm, EngineConfig(pool_tokens=len(ids) + c, residency=res, kv_dtype=kv_dtype))
    kv = engine.new_sequence()
    t0 = time.perf_counter()
    engine.prefill(kv, ids)
    prefill_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="kvflash-kv-bytes-") as tmp:
        with SnapshotStore(Path(tmp), args.codec, level=args.level) as store:
            snapshots = KVSnapshots(store, engine.fingerprint, prefetch=False)
            t0 = time.perf_counter()
            sid = snapshots.save(kv, "kv-bytes")
            save_s = time.perf_counter() - t0
            hashes = store.get_snapshot(sid).chunk_hashes
            shape = chunk_shape(lm.config, c)
            blobs = store.read_chunks_parallel(hashes, engine.fingerprint, shape, engine.kv_dtype)
            exact = all(
                torch.equal(b.kv.view(torch.uint8), kv.chunk_kv(i).view(torch.uint8))
                for i, b in enumerate(blobs)
            )
            du = store.du()
    kv.free()
    n = len(hashes)
    tokens = n * c
    meta = n * (HEADER_SIZE + 4 * c)
    raw = du.raw_bytes
    return {
        "kv_dtype": kv_dtype,
        "tokens": tokens,
        "chunks": n,
        "raw_per_token": raw / tokens,
        "payload_per_token": (du.stored_bytes - meta) / tokens,
        "chunk_meta_per_token": meta / tokens,
        "chunk_files_per_token": du.stored_bytes / tokens,
        "summaries_per_token": du.summaries_bytes / tokens,
        "on_disk_per_token": (du.stored_bytes + du.summaries_bytes) / tokens,
        "lossless_ratio": raw / (du.stored_bytes - meta),
        "read_back_exact": exact,
        "prefill_s": prefill_s,
        "save_s": save_s,
    }


def table(rows: list[dict], f16: int, codec: str) -> Table:
    t = Table(title=f"snapshot bytes per token ({codec}); f16 KV uncompressed: {f16:,} B/token")
    for col in (
        "KV dtype", "raw KV", "compressed KV", "ratio", "chunk files", "+ summaries file", "on disk",
        "vs f16", "read back exact",
    ):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["kv_dtype"],
            f"{r['raw_per_token']:,.0f}",
            f"{r['payload_per_token']:,.0f}",
            f"{r['lossless_ratio']:.3f}x",
            f"{r['chunk_files_per_token']:,.0f}",
            f"{r['summaries_per_token']:,.0f}",
            f"{r['on_disk_per_token']:,.0f}",
            f"{r['on_disk_per_token'] / f16:.2f}x",
            "yes" if r["read_back_exact"] else "NO",
        )
    return t


def plot(rows: list[dict], path: Path, f16: int) -> None:
    """Stacked bars per KV dtype: compressed KV, the chunk files' header and ids, the
    summaries file; a line at the uncompressed f16 KV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 3, 4))
    names = [r["kv_dtype"] for r in rows]
    bottom = [0.0] * len(rows)
    for label, key in (
        ("compressed KV", "payload_per_token"),
        ("chunk header, ids", "chunk_meta_per_token"),
        ("summaries file", "summaries_per_token"),
    ):
        values = [r[key] / 1000 for r in rows]
        ax.bar(names, values, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(f16 / 1000, color="black", linestyle="--", label="f16 KV, uncompressed")
    ax.set_ylabel("KB per token on disk")
    ax.set_title("snapshot bytes per token by KV dtype")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096, help="document length in tokens")
    ap.add_argument("--kv-dtypes", nargs="+", default=list(DTYPES), choices=list(KV_DTYPE_NAMES))
    ap.add_argument("--codec", default="lossless", choices=list(CODEC_NAMES))
    ap.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="zstd level")
    ap.add_argument("--out", default="out/kv_bytes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    lm = load_model(args.model, device=args.device)
    ids = lm.tokenizer.encode_plain(reference_text(args.tokens, lm.tokenizer))[: args.tokens]
    rows = []
    for kv_dtype in args.kv_dtypes:
        console.print(f"{kv_dtype}: prefill {len(ids):,} tokens")
        with torch.inference_mode():
            rows.append(measure(lm, ids, kv_dtype, args))
    f16 = lm.config.kv_bytes_per_token(torch.float16)
    console.print(table(rows, f16, args.codec))
    save(
        console, out / "kv_bytes", rows, lambda rs, path: plot(rs, path, f16), args,
        model=str(lm.path), model_dtype=str(lm.dtype), f16_per_token=f16,
    )  # fmt: skip


if __name__ == "__main__":
    main()
