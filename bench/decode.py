"""Decode speed of a long-document sequence: CUDA-graph replay against eager launches, side by side,
and against the memory's limit.

For each model and context, one sequence is prefilled with `context` tokens over a pool budget of
--pool-tokens (chunks beyond it live in the host tier), then decodes --tokens greedy tokens at a time,
eager and graph runs alternating --rounds times on that sequence (each run continues it). The limit
is the tokens per second at which the GPU would read, per token, every weight once (the embedding
table only where the output head shares it) and every resident chunk's KV, at the rate of a 4 GiB
device-to-device copy measured in the same run (bytes read + written per second). Prints one table,
writes JSON and a PNG.

  python -m bench.decode --models smollm2 llama-8b --contexts 8192 65536 --out out/decode
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.harness import (
    LLAMA_8B,
    bars,
    copy_bandwidth,
    out_dir,
    progress_bar,
    random_model,
    require_cuda,
    save,
)
from kvflash.config import EngineConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, Step, decode, eager_step
from kvflash.models.llama import LlamaForCausalLM
from kvflash.models.loader import LoadedModel, load_model


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads of the weights: all but an untied embedding table (one row of it)."""
    embed = model.model.embed_tokens.weight
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    if model.lm_head.weight.data_ptr() != embed.data_ptr():
        seen.pop(embed.data_ptr())
    return sum(seen.values())


def tokens_per_s(step: Step, kv, logits: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    """Greedy decode of n tokens as every answer runs it (`decode`); returns tok/s and the last logits."""
    gen = Generation(n + 1, Sampler(Sampling(), logits.device))
    last = {}

    def timed(tok: int, pos: int) -> torch.Tensor:
        last["logits"] = step(tok, pos)
        return last["logits"]

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = decode(timed, logits, len(kv.seq), gen)
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
    require_cuda("decode", "CUDA decode")
    out = out_dir(args.out)
    console = Console()
    rows = []
    with progress_bar(console=console) as progress:
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


if __name__ == "__main__":
    main()
