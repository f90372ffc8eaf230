"""Sweeps the paged decode kernel's launch settings at long context; prints the best per shape.

The default heuristics in kernels/triton_decode.py come from this sweep (docs/BENCHMARKS.md). Each
setting is timed as bench/kernels.py times decode (CUDA graph replay over enough distinct KV to
defeat L2) and reported as a share of the device copy bandwidth measured in the same run.

    python bench/decode_tune.py --out out/decode_tune.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from kernels import (
    CHUNK,
    DTYPE,
    L2_DEFEAT_BYTES,
    MODELS,
    contiguous,
    copy_bandwidth,
    graph_ms,
    paged_pool,
    sdpa,
)
from kvflash.kernels.triton_decode import WAVES, decode_launch, decode_splits, paged_decode_attention

SHAPES = [("SmolLM2", ctx, b) for ctx in (65536, 262144) for b in (1, 4)] + [
    ("Llama-8B", ctx, b) for ctx in (32768, 65536, 131072, 262144) for b in (1, 4)
]
SETTINGS = list(itertools.product((64, 128, 256), (4, 8), (2, 3), (1, 2, 4)))
"""(block tokens, warps, stages, splits as a multiple of the heuristic's)."""


def shape_timer(model: str, context: int, batch: int):
    """A function from a launch setting to GB/s of KV read, over one pool built for the shape, and
    SDPA's GB/s over the same KV laid out contiguously."""
    d, hq, h_kv = MODELS[model]
    n = context // CHUNK
    gbytes = batch * context * h_kv * d * 2 * DTYPE.itemsize / 1e9
    copies = -(-L2_DEFEAT_BYTES // int(gbytes * 1e9))
    pool, table = paged_pool(copies * batch, n, h_kv, d)
    q = torch.randn(copies * batch, hq, d, dtype=DTYPE, device="cuda")
    n_slots = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), CHUNK, dtype=torch.int32, device="cuda")

    def rate(setting: tuple) -> float:
        block, warps, stages, mult = setting
        cpi = max(1, block // CHUNK)
        tile = 2 * cpi * CHUNK * d * DTYPE.itemsize
        splits = min(4096, mult * decode_splits(-(-n // cpi), tile, batch, h_kv, q.device))
        kw = dict(n_splits=splits, block_tokens=block, num_warps=warps, num_stages=stages)
        calls = [
            lambda i=i: paged_decode_attention(
                q[i * batch : (i + 1) * batch], pool, 0, table[i * batch : (i + 1) * batch], n_slots, last,
                d**-0.5, **kw,
            )
            for i in range(copies)
        ]  # fmt: skip
        return gbytes / graph_ms(calls) * 1e3

    k, v = contiguous(pool, table)
    refs = [sdpa(q[i * batch : (i + 1) * batch, :, None], k[i * batch : (i + 1) * batch],
                 v[i * batch : (i + 1) * batch], causal=False)[0] for i in range(copies)]  # fmt: skip
    sdpa_rate = gbytes / graph_ms(refs) * 1e3
    del k, v
    return rate, sdpa_rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    copy = copy_bandwidth()
    rows = []
    for model, ctx, b in track(SHAPES, description="shapes"):
        timer, sdpa_gbps = shape_timer(model, ctx, b)
        rows.append({"model": model, "context": ctx, "batch": b, "setting": "sdpa", "gbps": sdpa_gbps})
        for s in SETTINGS:
            try:
                rate = timer(s)
            except Exception as e:  # a setting that does not compile (shared memory) is skipped
                rate = float("nan")
                print(f"{model} {ctx} {b} {s}: {type(e).__name__}")
            rows.append({"model": model, "context": ctx, "batch": b, "setting": s, "gbps": rate})
        del timer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)
    t = Table(title=f"decode launch settings (block, warps, stages, x waves), copy {copy:.0f} GB/s")
    for col in ("model", "ctx", "batch", "default", "% copy", "/ SDPA", "best", "% copy", "/ SDPA"):
        t.add_column(col)
    for model, ctx, b in SHAPES:
        mine = {
            r["setting"]: r["gbps"] for r in rows if (r["model"], r["context"], r["batch"]) == (model, ctx, b)
        }
        ref = mine.pop("sdpa")
        best = max((s for s in mine if mine[s] == mine[s]), key=mine.get)
        block, stages, waves = decode_launch(MODELS[model][0], b)
        base = (block, 4, stages, waves // WAVES)
        t.add_row(
            model, str(ctx), str(b), str(base), f"{mine[base] / copy:.1%}", f"{mine[base] / ref:.2f}",
            str(best), f"{mine[best] / copy:.1%}", f"{mine[best] / ref:.2f}",
        )  # fmt: skip
    Console().print(t)
    mean = {s: sum(r["gbps"] / copy for r in rows if r["setting"] == s) / len(SHAPES) for s in SETTINGS}
    top = sorted((s for s in SETTINGS if mean[s] == mean[s]), key=mean.get, reverse=True)[:5]
    Console().print("best on average over the shapes:", [(s, f"{mean[s]:.1%}") for s in top])


if __name__ == "__main__":
    main()
