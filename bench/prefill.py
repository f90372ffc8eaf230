"""Cold prefill speed of a long document: over a small pool, the whole context resident, and HF.

For each model and context, `context` random tokens are prefilled three ways, alternating --rounds
times in one process: *paged*, a kvflash sequence over a pool of --pool-tokens under the `qk`
policy (chunks beyond it go to the host tier, and each step scores and selects the chunks it
attends to); *resident*, a kvflash sequence over a pool that holds the whole context (policy
`full`: every step attends to every earlier token); and *hf*, HF transformers on the same ids with
the same weights (the whole prompt in one forward, SDPA, its KV all on the GPU): the peer a user
would pick. The *compute limit* is the time the resident arm's matrix work would take at the bf16
matrix rate measured in the same run (an 8192^3 matmul): 2 FLOP per weight per token plus the
causal attention's 4 * q-heads * head_dim FLOP per (query, key) pair per layer. After the timed
rounds, one more round of each kvflash arm runs under the profiler: the GPU's busy share is the
union of its kernels' intervals over the arm's steady time. Models have random weights (speed does
not depend on what they say). `--kv-dtype` sets the kvflash arms' KV (fp8: the e4m3 pool and its
kernels); HF keeps the model's dtype. Prints one table, writes JSON and a PNG.

Times are the median of the rounds after the first, which is reported apart (see `bench`).

  python -m bench.prefill --models smollm2 llama-8b --contexts 32768 131072 --out out/prefill
  python -m bench.prefill --models smollm2 --contexts 131072 --kv-dtype fp8 --out out/prefill_fp8
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import LLAMA_8B, SMOLLM2, bars, out_dir, progress_bar, random_model, require_cuda, save
from bench.hf import hf_llama, hf_prefill_s
from kvflash.config import KV_DTYPES, EngineConfig, ResidencyConfig, resolve_kv_dtype
from kvflash.engine.engine import Engine
from kvflash.engine.pool import chunk_bytes
from kvflash.models.loader import LoadedModel

MODELS = {"smollm2": SMOLLM2, "llama-8b": LLAMA_8B}


def matmul_tflops() -> float:
    """bf16 TFLOP/s of an 8192^3 matmul, best of 20."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    best = float("inf")
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ a
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return 2 * 8192**3 / best / 1e9


def dense_flops(lm: LoadedModel, tokens: int) -> float:
    """Matrix FLOPs of a causal prefill of `tokens` with every key resident (logits of the last token
    only, as the engine computes them)."""
    cfg = lm.config
    per_token = sum(  # the logits' product runs for the last token alone
        p.numel()
        for n, p in lm.model.named_parameters()
        if not n.endswith(("embed_tokens.weight", "lm_head.weight"))
    )
    attention = 4 * cfg.n_heads * cfg.head_dim * cfg.n_layers * tokens * (tokens + 1) / 2
    return 2 * per_token * tokens + 2 * cfg.vocab_size * cfg.hidden_size + attention


def prefill_s(eng: Engine, ids: list[int]) -> tuple[float, dict]:
    """Seconds of one prefill of ids as a new sequence of `eng`, and the bytes it moved between tiers."""
    kv = eng.new_sequence()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.prefill(kv, ids)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    moved = dict(kv.moved)
    kv.free()
    return seconds, moved


def gpu_busy_s(run) -> float:
    """Seconds the GPU spent in kernels (the union of their intervals) while run() ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6


def bench(lm: LoadedModel, name: str, context: int, args, tflops: float, progress, task) -> dict:
    """Each arm's engine serves every round, as a server's would; the steady time is the median of
    the later rounds, the first is reported apart (it pays what a new process pays: pinned host
    memory, Triton specialisations not yet loaded)."""
    ids = torch.randint(0, lm.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    chunk = 64
    slot = chunk_bytes(lm.config, chunk, resolve_kv_dtype(args.kv_dtype, lm.dtype, lm.device))
    host = (-(-context // chunk) + 4) * slot
    paged = EngineConfig(pool_tokens=args.pool_tokens, host_bytes=host, kv_dtype=args.kv_dtype)
    full = ResidencyConfig(policy="full")
    resident = EngineConfig(
        pool_tokens=context + 16 * chunk, host_bytes=slot, residency=full, kv_dtype=args.kv_dtype
    )
    engines = {"paged": Engine(lm, paged), "resident": Engine(lm, resident)}
    runs: dict[str, list[float]] = {arm: [] for arm in (*engines, "hf")}
    moved = {}
    for _ in range(args.rounds):
        for arm, eng in engines.items():
            seconds, moved[arm] = prefill_s(eng, ids)
            runs[arm].append(seconds)
            progress.advance(task)
    busy = {arm: gpu_busy_s(lambda eng=eng: prefill_s(eng, ids)) for arm, eng in engines.items()}
    del engines
    torch.cuda.empty_cache()
    hf = hf_llama(lm)
    hf_prefill_s(hf, ids[:256])  # its first forward pays cuBLAS and kernel selection
    for _ in range(args.rounds):
        runs["hf"].append(hf_prefill_s(hf, ids)[0])
        progress.advance(task)
    del hf
    torch.cuda.empty_cache()

    def steady(arm: str) -> float:
        return statistics.median(runs[arm][1:] or runs[arm])

    return {
        "model": name,
        "kv_dtype": args.kv_dtype,
        "context": context,
        "pool_tokens": args.pool_tokens,
        **{f"{arm}_s": steady(arm) for arm in runs},
        **{f"{arm}_first_s": runs[arm][0] for arm in runs},
        **{f"{arm}_runs": runs[arm] for arm in runs},
        **{f"{arm}_gpu_busy": busy[arm] / steady(arm) for arm in busy},
        "compute_limit_s": dense_flops(lm, context) / (tflops * 1e12),
        "paged_moved": moved["paged"],
    }


def table(rows: list[dict], tflops: float) -> Table:
    t = Table(title=f"cold prefill on {torch.cuda.get_device_name()}: matmul {tflops:,.0f} TFLOP/s (bf16)")
    for col in ("model", "KV", "context", "pool", "paged s (first)", "paged GPU busy", "host->GPU GB",
                "resident s (first)", "resident GPU busy", "HF s (first)", "paged / HF",
                "compute limit s"):  # fmt: skip
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        t.add_row(
            r["model"], r["kv_dtype"], f"{r['context']:,}", f"{r['pool_tokens']:,}",
            f"{r['paged_s']:.2f} ({r['paged_first_s']:.2f})", f"{r['paged_gpu_busy']:.0%}",
            f"{r['paged_moved']['host_to_gpu'] / 1e9:.2f}",
            f"{r['resident_s']:.2f} ({r['resident_first_s']:.2f})", f"{r['resident_gpu_busy']:.0%}",
            f"{r['hf_s']:.2f} ({r['hf_first_s']:.2f})", f"{r['paged_s'] / r['hf_s']:.2f}x",
            f"{r['compute_limit_s']:.3f}",
        )  # fmt: skip
    return t


def plot(rows: list[dict], path: Path) -> None:
    series = [
        (f"kvflash paged ({rows[0]['pool_tokens']:,}-token pool)", "paged_s", None),
        ("kvflash, whole context resident", "resident_s", None),
        ("HF transformers (whole KV on the GPU)", "hf_s", "0.5"),
        ("compute limit, whole context resident", "compute_limit_s", "0.8"),
    ]
    bars(rows, series, "seconds (log)", f"cold prefill, {torch.cuda.get_device_name()}", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama-8b"], choices=list(MODELS))
    ap.add_argument("--contexts", nargs="+", type=int, default=[32768, 131072])
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="the kvflash arms' KV dtype")
    ap.add_argument("--rounds", type=int, default=3, help="paged/resident alternations (the first is cold)")
    ap.add_argument("--out", default="out/prefill")
    args = ap.parse_args()
    require_cuda("prefill", "CUDA prefill")
    out = out_dir(args.out)
    console = Console()
    rows = []
    with progress_bar(console=console) as progress:
        tflops = matmul_tflops()
        for name in args.models:
            lm = random_model(MODELS[name])
            for context in args.contexts:
                task = progress.add_task(f"{name} {context // 1024}K", total=3 * args.rounds)
                rows.append(bench(lm, name, context, args, tflops, progress, task))
            del lm
            torch.cuda.empty_cache()
    console.print(table(rows, tflops))
    save(console, out / "prefill", rows, plot, args, matmul_tflops=tflops)


if __name__ == "__main__":
    main()
