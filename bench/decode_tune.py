"""Sweeps the paged decode kernel's launch settings at long context; prints the best per shape.

The default heuristics in kvflash/kernels/triton_decode.py come from this sweep
(docs/BENCHMARKS.md). Each setting is timed as bench/kernel_speed.py times decode (CUDA graph replay
over enough distinct KV to defeat L2) and reported as a share of the device copy bandwidth measured
in the same run. A setting is (merge, block tokens, warps, stages, waves, kv-heads, registers):
merge `fused` has the last split to finish merge the partials in the same launch, `2k` runs a
second combine kernel; waves sets the split count through `decode_splits`; kv-heads is what one
program serves (`decode_heads`, or a count: `--heads rule 1 2` times an fp8 pool's stacked heads
against one and two a program); registers caps a thread's (`--max-registers rule 168`: as many
as the compiler takes against 168, which lets a program of 198 share its SM with two more;
bench/kernel_sass.py counts programs an SM without a GPU). Each shape also times both merges at
their own defaults, and the JSON is rewritten after every shape, so a run cut short keeps what it
measured.

    python -m bench.decode_tune --out out/decode_tune.json
    # fused against two-kernel at the rule's tiles, batch 1-16, 8K-256K:
    python -m bench.decode_tune --out out/decode_fused.json --rule --warps 4 \\
        --contexts 8192 16384 32768 65536 131072 262144 --batches 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import itertools

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from bench.harness import copy_bandwidth, write_json
from bench.kernel_speed import (
    CHUNK,
    CONTEXTS,
    DTYPE,
    L2_DEFEAT_BYTES,
    MODELS,
    contiguous,
    graph_ms,
    kv_gbytes,
    paged_pool,
    sdpa,
    to_fp8,
    to_values,
)
from kvflash.kernels.triton_decode import decode_grid, decode_launch, paged_decode_attention

SHAPES = [("SmolLM2", ctx, b) for ctx in (65536, 262144) for b in (1, 4)] + [
    ("Llama-8B", ctx, b) for ctx in (32768, 65536, 131072, 262144) for b in (1, 4)
]
"""The default shapes: long context at small batch, where the launch settings matter."""
MERGES = {"fused": True, "2k": False}

Setting = tuple[str, int | None, int, int | None, float, int | None, int | None]
"""(merge, block tokens, warps, stages, waves, kv-heads a program, registers a thread at most);
block, stages and registers None: the rule's (`decode_launch`), kv-heads None: `decode_heads`'."""


def default_setting(merge: str, head_dim: int, batch: int, rule: bool, kv_bytes: int = 2) -> Setting:
    """What paged_decode_attention picks by itself with this merge."""
    launch = decode_launch(head_dim, batch, kv_bytes)
    return (
        merge,
        None if rule else launch.block_tokens,
        launch.warps,
        None if rule else launch.stages,
        launch.waves,
        None,
        None,
    )


def shape_timer(model: str, context: int, batch: int, fp8: bool = False):
    """A function from a launch setting to (splits, GB/s of KV read), over one pool built for the
    shape (fp8: e4m3 with its scale rows, its values counted in their own bytes), and SDPA's GB/s
    over the same KV (fp8: its values in bf16) laid out contiguously."""
    d, hq, h_kv = MODELS[model]
    n, kv_bytes = context // CHUNK, 1 if fp8 else DTYPE.itemsize
    gbytes = kv_gbytes(model, context, batch, fp8)
    copies = -(-L2_DEFEAT_BYTES // int(gbytes * 1e9))
    pool, table = paged_pool(copies * batch, n, h_kv, d)
    if fp8:
        pool = to_fp8(pool)
    q = torch.randn(copies * batch, hq, d, dtype=DTYPE, device="cuda")
    n_slots = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    last = torch.full((batch,), CHUNK, dtype=torch.int32, device="cuda")
    timed: dict[tuple, float] = {}

    def rate(setting: Setting) -> tuple[int, float]:
        merge, block, warps, stages, waves, heads, regs = setting
        launch = decode_launch(d, batch, kv_bytes)
        block, stages = block or launch.block_tokens, stages or launch.stages
        heads, _, splits, _ = decode_grid(pool, batch, hq, n, False, q.device, block, heads, waves)
        kw = dict(
            fused=MERGES[merge], n_splits=splits, block_tokens=block, num_warps=warps, num_stages=stages,
            heads=heads, max_registers=regs,
        )  # fmt: skip
        key = tuple(kw.values())
        if key not in timed:  # several waves can give the same split count
            calls = [
                lambda i=i: paged_decode_attention(
                    q[i * batch : (i + 1) * batch], pool, 0, table[i * batch : (i + 1) * batch], n_slots,
                    last, d**-0.5, **kw,
                )
                for i in range(copies)
            ]  # fmt: skip
            timed[key] = gbytes / graph_ms(calls) * 1e3
        return splits, timed[key]

    k, v = contiguous(to_values(pool) if fp8 else pool, table)
    refs = [sdpa(q[i * batch : (i + 1) * batch, :, None], k[i * batch : (i + 1) * batch],
                 v[i * batch : (i + 1) * batch], causal=False)[0] for i in range(copies)]  # fmt: skip
    sdpa_rate = gbytes / graph_ms(refs) * 1e3
    del k, v
    return rate, sdpa_rate


def show(setting: Setting) -> str:
    """block/warps/stages/waves/kv-heads/registers, `-` where the rule decides."""
    _, block, warps, stages, waves, heads, regs = setting
    return f"{block or '-'}/{warps}/{stages or '-'}/{waves:g}/{heads or '-'}/{regs or '-'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--contexts", nargs="+", type=int, help="with --batches: every model x context x batch")
    ap.add_argument("--batches", nargs="+", type=int, help="(default shapes: SHAPES)")
    ap.add_argument("--merge", nargs="+", choices=list(MERGES), default=list(MERGES))
    ap.add_argument("--blocks", nargs="+", type=int, default=[64, 128, 256], help="tokens per loop iteration")
    ap.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--waves", nargs="+", type=float, default=[0.5, 1, 2, 4, 8], help="sets the split count")
    ap.add_argument("--rule", action="store_true", help="blocks and stages from decode_launch, not swept")
    ap.add_argument("--fp8", action="store_true", help="an fp8 pool (e4m3 and its scale rows)")
    ap.add_argument(
        "--heads", nargs="+", default=["rule"],
        help="kv-heads a program: `rule` (decode_heads') or a count that divides the model's (fp8 only)",
    )  # fmt: skip
    ap.add_argument(
        "--max-registers", nargs="+", default=["rule"],
        help="registers a thread at most (maxnreg): `rule` (decode_launch's) or a count",
    )  # fmt: skip
    args = ap.parse_args()
    if args.contexts or args.batches:
        shapes = list(itertools.product(args.models, args.contexts or CONTEXTS, args.batches or [1, 4]))
    else:
        shapes = [s for s in SHAPES if s[0] in args.models]
    blocks, stages = ([None], [None]) if args.rule else (args.blocks, args.stages)
    heads = [None if h == "rule" else int(h) for h in args.heads]
    regs = [None if r == "rule" else int(r) for r in args.max_registers]
    sweep = list(itertools.product(args.merge, blocks, args.warps, stages, args.waves, heads, regs))
    copy = copy_bandwidth()
    rows = []
    kv_bytes = 1 if args.fp8 else DTYPE.itemsize
    for model, ctx, b in track(shapes, description="shapes"):
        timer, sdpa_gbps = shape_timer(model, ctx, b, args.fp8)
        rows.append({"model": model, "context": ctx, "batch": b, "setting": "sdpa", "gbps": sdpa_gbps})
        defaults = [default_setting(m, MODELS[model][0], b, args.rule, kv_bytes) for m in args.merge]
        for s in dict.fromkeys(sweep + defaults):
            try:
                splits, rate = timer(s)
            except Exception as e:  # a setting that does not compile (shared memory) is skipped
                splits, rate = None, float("nan")
                print(f"{model} {ctx} {b} {show(s)}: {type(e).__name__}")
            row = {"model": model, "context": ctx, "batch": b, "setting": s, "splits": splits, "gbps": rate}
            rows.append(row)
        del timer
        torch.cuda.empty_cache()
        write_json(args.out, {"copy_gbps": copy, "rows": rows})

    t = Table(title=f"decode, share of copy bandwidth ({copy:.0f} GB/s): each merge's default and best")
    for col in ("model", "ctx", "batch", "SDPA"):
        t.add_column(col)
    for m in args.merge:
        t.add_column(f"{m} default")
        t.add_column(f"{m} best")
        t.add_column(f"{m} at block/warps/stages/waves/kv-heads/registers (splits)")
    for model, ctx, b in shapes:
        mine = {r["setting"]: r for r in rows if (r["model"], r["context"], r["batch"]) == (model, ctx, b)}
        cells = [model, str(ctx), str(b), f"{mine.pop('sdpa')['gbps'] / copy:.1%}"]
        for m in args.merge:
            ok = [s for s in mine if s[0] == m and mine[s]["gbps"] == mine[s]["gbps"]]
            best = max(ok, key=lambda s: mine[s]["gbps"])
            base = mine[default_setting(m, MODELS[model][0], b, args.rule, kv_bytes)]
            cells += [f"{base['gbps'] / copy:.1%}", f"{mine[best]['gbps'] / copy:.1%}"]
            cells.append(f"{show(best)} ({mine[best]['splits']})")
        t.add_row(*cells)
    Console().print(t)
    share = {s: [r["gbps"] / copy for r in rows if r["setting"] == s] for s in sweep}
    mean = {s: sum(v) / len(v) for s, v in share.items() if v and all(x == x for x in v)}
    top = sorted(mean, key=mean.get, reverse=True)[:5]
    Console().print("best on average over the shapes:", [(s[0], show(s), f"{mean[s]:.1%}") for s in top])


if __name__ == "__main__":
    main()
