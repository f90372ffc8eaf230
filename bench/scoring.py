"""Exact chunk scoring (`chunk_lse`, what the `qk` policy runs at a question's scouts and at decode
re-selection) through the Triton kernel against its torch twin (the engine's path before the kernel),
side by side on one CUDA device, and against the memory's limit.

For each model shape, number of candidate chunks N and recorded query tokens T (1: a decode step's
query, 32: a question's scouts), every layer's queries score N chunks of a pool in shuffled slots, with
and without per-chunk rotations (positions within the cache), each result written into the [L, T, Hq, N]
log-mass table as `ChunkScorer.exact` writes it: the kernel in one call, the twin in the batches
that bound its fp32 logits (SCORE_BYTES), as the engine ran it. The limit is the time to read the N
chunks' keys once at the rate of a 4 GiB device-to-device copy measured in the same run (bytes read
+ written per second); the kernel reads nothing else of size. Times are GPU times (`do_bench`), the
calls launched eagerly as the engine launches them. Prints one table, writes JSON and a PNG.

  python -m bench.scoring --out out/scoring
"""

from __future__ import annotations

import argparse
import itertools
import platform
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table
from triton.testing import do_bench

from bench.harness import copy_bandwidth, out_dir, pyplot, save_png, write_json
from bench.kernel_speed import CHUNK, DTYPE
from kvflash.engine.scoring import SCORE_BYTES
from kvflash.kernels import reference
from kvflash.kernels.triton_scoring import chunk_lse

MODELS = {"SmolLM2": (30, 64, 9, 3), "Llama-8B": (32, 128, 32, 8)}
"""name -> (layers, head_dim, q heads, kv heads)."""


def bench(model: str, n: int, t: int, shifted: bool, copy_gbps: float) -> dict:
    layers, d, hq, h_kv = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(n + t)
    pool = torch.randn(2 * n, layers, 2, h_kv, CHUNK, d, dtype=DTYPE, device="cuda", generator=g)
    slots = torch.randperm(2 * n, device="cuda", generator=g)[:n].int()
    q = torch.randn(layers, t, hq, d, device="cuda", generator=g)
    ang = torch.rand(n, d // 2, device="cuda", generator=g) * 100
    rot = torch.stack([ang.cos(), ang.sin()], 1) if shifted else None
    batch = max(1, SCORE_BYTES // (layers * t * hq * CHUNK * 4))
    lse_ours, lse_twin = (torch.empty(layers, t, hq, n, device="cuda") for _ in range(2))

    def ours() -> None:
        lse_ours[:] = chunk_lse(q, pool, slots, rot)

    def twin() -> None:
        for lo in range(0, n, batch):
            part = slice(lo, lo + batch)
            rows = None if rot is None else rot[part]
            lse_twin[..., part] = reference.chunk_lse(q, pool, slots[part], rows)

    ours(), twin()
    err = (lse_ours - lse_twin).abs().max().item()
    t_ours = do_bench(ours, warmup=5, rep=40)
    t_twin = do_bench(twin, warmup=5, rep=40)
    key_bytes = n * layers * h_kv * CHUNK * d * DTYPE.itemsize
    t_limit = key_bytes / copy_gbps / 1e6
    return {
        "model": model, "chunks": n, "queries": t, "shifted": shifted, "key_mb": key_bytes / 1e6,
        "ours_ms": t_ours, "torch_ms": t_twin, "limit_ms": t_limit, "max_err": err,
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(9, 4.2))
    labels = [f"{r['model']} N={r['chunks']} T={r['queries']}{' rot' if r['shifted'] else ''}" for r in rows]
    x = range(len(rows))
    bars = ((-0.27, "torch_ms", "torch twin"), (0, "ours_ms", "Triton"), (0.27, "limit_ms", "limit"))
    for off, key, name in bars:
        ax.bar([i + off for i in x], [r[key] for r in rows], width=0.27, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("ms per call")
    ax.set_xticks(list(x), labels, fontsize=6, rotation=60, ha="right")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--chunks", nargs="+", type=int, default=[128, 1024])
    ap.add_argument("--queries", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--out", default="out/scoring")
    args = ap.parse_args()
    out = out_dir(args.out)
    copy_gbps = copy_bandwidth()
    rows = []
    for model, n, t, shifted in itertools.product(args.models, args.chunks, args.queries, (False, True)):
        rows.append(bench(model, n, t, shifted, copy_gbps))
        torch.cuda.empty_cache()
    table = Table(title=f"chunk scoring on {torch.cuda.get_device_name()}: copy {copy_gbps:,.0f} GB/s")
    for col in ("model", "N", "T", "rot", "keys MB", "torch ms", "Triton ms", "speed-up", "limit ms",
                "Triton / limit", "max err"):  # fmt: skip
        table.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        table.add_row(
            r["model"], str(r["chunks"]), str(r["queries"]), "yes" if r["shifted"] else "no",
            f"{r['key_mb']:.0f}", f"{r['torch_ms']:.3f}", f"{r['ours_ms']:.3f}",
            f"{r['torch_ms'] / r['ours_ms']:.1f}x", f"{r['limit_ms']:.3f}",
            f"{r['limit_ms'] / r['ours_ms']:.0%}", f"{r['max_err']:.1e}",
        )  # fmt: skip
    Console(width=160).print(table)
    meta = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "copy_gbps": copy_gbps,
    }  # fmt: skip
    write_json(out / "scoring.json", {**meta, "rows": rows})
    plot(rows, out / "scoring.png")
    print(f"wrote {out / 'scoring.json'} and {out / 'scoring.png'}")


if __name__ == "__main__":
    main()
