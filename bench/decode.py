"""Decode speed of a long-document sequence: CUDA-graph replay against eager launches, side by side,
and against the memory's limit.

For each model and context, one sequence is prefilled with `context` tokens over a pool budget of
--pool-tokens (chunks beyond it live in the host tier), then decodes --tokens greedy tokens at a time,
eager and graph runs alternating --rounds times on that sequence (each run continues it). The limit
is the tokens per second at which the GPU would read, per token, every weight once (the embedding
table only where the output head shares it) and every resident chunk's KV, at the rate of a 4 GiB
device-to-device copy measured in the same run (bytes read + written per second). Prints one table,
writes JSON and a PNG.

  python bench/decode.py --models smollm2 llama-8b --contexts 8192 65536 --out out/decode
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvflash.config import EngineConfig, ModelConfig
from kvflash.engine import Engine
from kvflash.generate import Sampler, Sampling, Step, decode, eager_step
from kvflash.models.llama import LlamaForCausalLM
from kvflash.models.loader import LoadedModel, build_model, load_model

LLAMA_8B = ModelConfig(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
    n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=1 << 20,
)  # fmt: skip
"""Llama-3-8B's shape, with random weights: speed does not depend on what the weights say."""


def random_model(cfg: ModelConfig) -> LoadedModel:
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    weights = {k: torch.empty(s, dtype=bf16, device=dev).normal_(0.0, 0.02) for k, s in shapes.items()}
    return LoadedModel(build_model(cfg, weights, bf16, dev), None, cfg, Path("random"), bf16, dev)


def copy_bandwidth() -> float:
    """GB/s of traffic (read + write) of a 4 GiB device-to-device copy, best of 20."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return 2 * src.numel() / best / 1e6


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads of the weights: all but an untied embedding table (one row of it)."""
    embed = model.model.embed_tokens.weight
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    if model.lm_head.weight.data_ptr() != embed.data_ptr():
        seen.pop(embed.data_ptr())
    return sum(seen.values())


def tokens_per_s(step: Step, kv, logits: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    """Greedy decode of n tokens as `Engine.generate` runs it; returns tok/s and the last logits."""
    sampler = Sampler(Sampling(), logits.device)
    last = {}

    def timed(tok: int, pos: int) -> torch.Tensor:
        last["logits"] = step(tok, pos)
        return last["logits"]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = list(decode(timed, logits, len(kv.seq), n + 1, sampler))
    torch.cuda.synchronize()
    assert len(out) == n + 1
    return n / (time.perf_counter() - t0), last["logits"]


def bench(lm: LoadedModel, name: str, context: int, args, copy_gbps: float, progress, task) -> dict:
    c = 64
    host = (context + args.rounds * 2 * (args.tokens + 1) + 4 * c) * lm.config.kv_bytes_per_token(lm.dtype)
    eng = Engine(lm, EngineConfig(pool_tokens=args.pool_tokens, host_bytes=host))
    kv = eng.new_sequence()
    ids = torch.randint(0, lm.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    logits = eng.prefill(kv, ids.tolist())
    graphs, replays = eng.decode_step(kv), eng.batch_graphs
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = graphs(int(logits.argmax()), len(kv.seq))  # replays the graph the engine's warm-up took
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    eager, graph = [], []
    for _ in range(args.rounds):
        rate, logits = tokens_per_s(eager_step(lm.model, kv), kv, logits, args.tokens)
        eager.append(rate)
        progress.advance(task)
        before = replays.replays
        rate, logits = tokens_per_s(graphs, kv, logits, args.tokens)
        graph.append(rate)
        progress.advance(task)
        replayed = replays.replays - before
    resident = len(kv.resident()) * kv.chunk_nbytes
    step_bytes = weight_bytes(lm.model) + resident
    limit = copy_gbps * 1e9 / step_bytes
    kv.free()
    del eng
    torch.cuda.empty_cache()
    return {
        "model": name,
        "context": context,
        "pool_tokens": args.pool_tokens,
        "eager_tok_s": statistics.median(eager),
        "graph_tok_s": statistics.median(graph),
        "eager_runs": eager,
        "graph_runs": graph,
        "graph_replayed_share": replayed / args.tokens,
        "first_step_s": first_s,
        "step_bytes": step_bytes,
        "limit_tok_s": limit,
    }


def table(rows: list[dict], copy_gbps: float) -> Table:
    t = Table(title=f"decode on {torch.cuda.get_device_name()}: copy {copy_gbps:,.0f} GB/s (read+write)")
    for col in ("model", "context", "eager tok/s", "graph tok/s", "graph/eager", "limit tok/s",
                "graph/limit", "replayed", "first step s"):  # fmt: skip
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        t.add_row(
            r["model"], f"{r['context']:,}", f"{r['eager_tok_s']:.0f}", f"{r['graph_tok_s']:.0f}",
            f"{r['graph_tok_s'] / r['eager_tok_s']:.2f}x", f"{r['limit_tok_s']:.0f}",
            f"{r['graph_tok_s'] / r['limit_tok_s']:.0%}", f"{r['graph_replayed_share']:.0%}",
            f"{r['first_step_s']:.3f}",
        )  # fmt: skip
    return t


def plot(rows: list[dict], path: Path) -> None:
    series = [("eager", "eager_tok_s", None), ("CUDA graph", "graph_tok_s", None),
              ("memory limit", "limit_tok_s", "0.8")]  # fmt: skip
    title = f"decode, pool {rows[0]['pool_tokens']:,} tokens, {torch.cuda.get_device_name()}"
    bars(rows, series, "tokens / s (log)", title, path)


def bars(
    rows: list[dict],
    series: list[tuple[str, str, str | None]],
    ylabel: str,
    title: str,
    path: Path,
    group: Callable[[dict], str] = lambda r: f"{r['model']}\n{r['context'] // 1024}K",
) -> None:
    """One group of bars per row (named by `group`, by default model and context), one bar per
    (label, row key, colour) series, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    w = 0.8 / len(series)
    for k, (label, key, color) in enumerate(series):
        ax.bar(
            [i + (k - (len(series) - 1) / 2) * w for i in x],
            [r[key] for r in rows],
            w,
            label=label,
            color=color,
        )
    ax.set_xticks(list(x), [group(r) for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "llama-8b"], choices=["smollm2", "llama-8b"])
    ap.add_argument("--model-path", default=None, help="SmolLM2 GGUF (default: the pulled default model)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 65536])
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per timed run")
    ap.add_argument("--rounds", type=int, default=3, help="eager/graph alternations")
    ap.add_argument("--out", default="out/decode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode.py measures CUDA decode; no CUDA device here")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    rows = []
    with Progress(console=console) as progress:
        copy_gbps = copy_bandwidth()
        for name in args.models:
            lm = load_model(args.model_path, dtype="bf16", device="cuda") if name == "smollm2" else None
            lm = lm or random_model(LLAMA_8B)
            for context in args.contexts:
                task = progress.add_task(f"{name} {context // 1024}K", total=2 * args.rounds)
                rows.append(bench(lm, name, context, args, copy_gbps, progress, task))
            del lm
            torch.cuda.empty_cache()
    console.print(table(rows, copy_gbps))
    save(console, out / "decode", rows, plot, args, copy_gbps=copy_gbps)


def save(console: Console, stem: Path, rows: list[dict], plot_rows, args, **meta) -> None:
    """Writes stem.json (the rows and the run: device, versions, date, arguments, `meta`) and the
    plot_rows(rows, path) picture as stem.png."""
    run = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        **meta,
        "args": vars(args),
    }
    json_path, png = stem.with_suffix(".json"), stem.with_suffix(".png")
    json_path.write_text(json.dumps({"meta": run, "rows": rows}, indent=1))
    plot_rows(rows, png)
    console.print(f"wrote {json_path} and {png}")


if __name__ == "__main__":
    main()
