"""Kernel benchmark on one CUDA device; prints one table and writes JSON (--out).

Decode attention is bound by memory bandwidth, so it is reported as bytes of KV read per second,
next to the device-to-device copy bandwidth measured in the same run (bytes read + written per
second: the traffic the memory sustains) and next to torch SDPA over the same KV laid out
contiguously, and next to the read limit: a plain streaming read of the same bytes from the same
buffer, timed the same way, which is the most any single kernel reading that many bytes reaches
(small reads fall short of the copy rate: the launch, the ramp-up and the last partial wave are
a fixed few microseconds). Prefill attention is compute bound: TFLOP/s against SDPA's flash path on the same
causal shape. Targets: decode >= 85% of copy at long context and >= SDPA; prefill >= 80%.

`--fp8` measures decode over a pool of fp8 KV (e4m3, with its scale rows) against a bf16 pool of
the same shape, side by side in one run, at 64K-256K tokens and batch 16 and up: tokens/s of one
layer's attention (sequences per call / call time) and the share of copy bandwidth, counted in the
fp8 pool's bytes. Targets: >= 1.7x bf16's tokens/s, >= 85 % of copy. Its SDPA column is SDPA over
the fp8 KV's values in bf16 (the max error is against it).

Times are GPU times: each side's calls are replayed from one CUDA graph, so Python launch overhead
(tens of microseconds, larger than the whole kernel at small shapes) is left out: this measures the
kernels, one layer's attention at a time (bench/decode.py measures the engine's decode step). Each
graph reads at least L2_DEFEAT_BYTES of distinct KV, so small shapes are not served from
the 60 MB L2.

    python -m bench.kernel_speed --out docs/kernels.json
    python -m bench.kernel_speed --fp8 --out docs/kernels-fp8.json
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from bench.harness import copy_bandwidth, progress_bar, pyplot, require_cuda, save_png, write_json
from kvflash.kernels import reference
from kvflash.kernels.triton_decode import paged_decode_attention
from kvflash.kernels.triton_prefill import prefill_attention

MODELS = {"SmolLM2": (64, 9, 3), "Llama-8B": (128, 32, 8)}
"""name -> (head_dim, q heads, kv heads)."""
CONTEXTS = [8192, 16384, 32768, 65536, 131072, 262144]
BATCHES = [1, 4, 16, 64]
PREFILL_TOKENS = [4096, 16384]
CHUNK = 64
DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_CONTEXTS = [65536, 131072, 262144]
FP8_BATCHES = [16, 64]
LONG_CONTEXT = 65536
"""Contexts from here on count as long for the decode target."""
L2_DEFEAT_BYTES = 512 << 20
SETTLE_BYTES = 4 << 30
SETTLE_S = 1.0
"""Where more than SETTLE_BYTES were freed, wait SETTLE_S before timing: a batch-1 paged decode
measured right after tens of GB were freed reads several points of copy bandwidth low (10 at once,
none after 0.5 s), an artefact of the harness freeing its buffers, not of a serving engine, which
allocates its pool once (docs/BENCHMARKS.md: Kernels, "Decode launch rules and why"). A shape frees
that much before its own timing too: an fp8 shape its bf16 pool, any shape its gathered K and V."""


def settle() -> None:
    """Returns freed memory to the device and waits SETTLE_S if more than SETTLE_BYTES were freed
    since the last call (the peak allocated then less what is allocated now)."""
    torch.cuda.empty_cache()
    if torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() > SETTLE_BYTES:
        time.sleep(SETTLE_S)
    torch.cuda.reset_peak_memory_stats()


@dataclass
class Row:
    kernel: str
    model: str
    context: int
    batch: int
    gbytes: float
    ours_ms: float
    sdpa_ms: float
    sdpa_backend: str
    ours_rate: float
    sdpa_rate: float
    of_copy: float | None
    max_err: float
    read_rate: float | None = None
    """GB/s of the streaming read of the same bytes (decode only)."""
    kv: str = "bf16"
    """The pool's KV dtype (decode)."""

    @property
    def tokens_per_s(self) -> float | None:
        """Decode: sequences attended per second, one token each, one layer (None for prefill)."""
        return self.batch / self.ours_ms * 1e3 if self.kernel == "decode" else None


READ_BLOCK = 4096
"""Elements each step of the streaming read loads: 8 KB of bf16, 16 per thread at 8 warps."""


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Reads STEPS * BLOCK contiguous elements and writes their sum, so no load is optimised away."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_limit(buffers: list[torch.Tensor]) -> float:
    """GB/s of the fastest streaming read (2 or 4 steps a program: many short programs read fastest
    at the sizes this bench reads) over each buffer once, all replayed from one graph."""
    best = 0.0
    for steps in (2, 4):
        calls = []
        for x in buffers:
            progs = triton.cdiv(x.numel(), READ_BLOCK * steps)
            out = torch.empty(progs, dtype=torch.float32, device=x.device)
            calls.append(
                lambda x=x, out=out, progs=progs, steps=steps: _stream_read_kernel[(progs,)](
                    x, out, x.numel(), BLOCK=READ_BLOCK, STEPS=steps, num_warps=8
                )
            )
        nbytes = sum(x.numel() * x.element_size() for x in buffers) / len(buffers)
        best = max(best, nbytes / graph_ms(calls) / 1e6)
    return best


def graph_ms(calls: list[Callable[[], object]]) -> float:
    """Mean GPU milliseconds per call, the calls captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=10, rep=60) / len(calls)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[Callable, str]:
    """SDPA restricted to its flash path (GQA native); the efficient path with heads repeated if not."""

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    try:
        flash()
        return flash, "flash"
    except RuntimeError:
        g = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def efficient():
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)

        return efficient, "efficient"


def paged_pool(batch: int, n: int, h_kv: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-layer pool of batch * n chunks and a shuffled slot table, like a long-running server's."""
    pool = torch.randn(batch * n, 1, 2, h_kv, CHUNK, d, dtype=DTYPE, device="cuda")
    table = torch.randperm(batch * n, device="cuda", dtype=torch.int32).view(batch, n)
    return pool, table


def to_fp8(pool: torch.Tensor, step: int = 4096) -> torch.Tensor:
    """The pool's KV in an fp8 pool (a scale row per block, V channel-major, as kvflash/engine/pool.py
    lays it out), each block scaled by its largest magnitude / 448, as a prefill writes whole chunks;
    a few thousand slots at a time."""
    out = torch.zeros(*pool.shape[:4], CHUNK + 1, pool.shape[5], dtype=FP8, device=pool.device)
    for lo in range(0, pool.shape[0], step):
        reference.fp8_whole_chunks(pool[lo : lo + step], out[lo : lo + step])
    return out


def to_values(pool: torch.Tensor, step: int = 4096) -> torch.Tensor:
    """An fp8 pool's values as a bf16 pool (SDPA's input)."""
    out = torch.empty(*pool.shape[:4], CHUNK, pool.shape[5], dtype=DTYPE, device=pool.device)
    for lo in range(0, pool.shape[0], step):
        out[lo : lo + step] = reference.kv_values(pool[lo : lo + step]).to(DTYPE)
    return out


def contiguous(pool: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V as [B, Hkv, N, D] tensors in logical order."""
    b, n = table.shape
    kv = pool[table.flatten().long(), 0].view(b, n, 2, pool.shape[3], CHUNK, pool.shape[5])
    kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, b, pool.shape[3], n * CHUNK, pool.shape[5])
    return kv[0], kv[1]


def kv_gbytes(model: str, context: int, batch: int, fp8: bool) -> float:
    """GB of K and V values a decode call reads: its tokens' keys and values in the pool's dtype. An
    fp8 block's scale row is not counted (the kernel reads 4 of its bytes), so fp8 shares of copy
    are of the values themselves."""
    d, _, h_kv = MODELS[model]
    return batch * context * h_kv * d * 2 * (1 if fp8 else DTYPE.itemsize) / 1e9


def bench_decode(model: str, context: int, batch: int, copy_gbps: float, kv: str = "bf16") -> Row:
    d, hq, h_kv = MODELS[model]
    n = context // CHUNK
    fp8 = kv == "fp8"
    gbytes = kv_gbytes(model, context, batch, fp8)
    copies = -(-L2_DEFEAT_BYTES // int(gbytes * 1e9))
    pool, table = paged_pool(copies * batch, n, h_kv, d)
    if fp8:
        pool = to_fp8(pool)
    k, v = contiguous(to_values(pool) if fp8 else pool, table)
    q = torch.randn(copies * batch, hq, d, dtype=DTYPE, device="cuda")
    n_slots = torch.full((batch,), n, dtype=torch.int32, device="cuda")
    last_valid = torch.full((batch,), CHUNK, dtype=torch.int32, device="cuda")
    ours, refs = [], []
    for i in range(copies):
        rows = slice(i * batch, (i + 1) * batch)
        qi, ti = q[rows], table[rows]
        ours.append(
            lambda qi=qi, ti=ti: paged_decode_attention(qi, pool, 0, ti, n_slots, last_valid, d**-0.5)
        )
        ref, backend = sdpa(qi[:, :, None], k[rows], v[rows], causal=False)
        refs.append(ref)
    err = (ours[0]().float() - refs[0]()[:, :, 0].float()).abs().max().item()
    settle()
    t_ours, t_sdpa = graph_ms(ours), graph_ms(refs)
    rate = gbytes / t_ours * 1e3
    read = read_limit(list(pool.view(copies, -1)))
    return Row(
        "decode", model, context, batch, gbytes, t_ours, t_sdpa, backend,
        rate, gbytes / t_sdpa * 1e3, rate / copy_gbps, err, read, kv,
    )  # fmt: skip


def bench_prefill(model: str, tokens: int) -> Row:
    d, hq, h_kv = MODELS[model]
    n = tokens // CHUNK
    pool, table = paged_pool(1, n, h_kv, d)
    slots = table[0].contiguous()
    chunk_index = torch.arange(n, dtype=torch.int32, device="cuda")
    q = torch.randn(tokens, hq, d, dtype=DTYPE, device="cuda")

    def ours():
        return prefill_attention(q, pool, 0, slots, chunk_index, 0, d**-0.5)

    k, v = contiguous(pool, table)
    ref, backend = sdpa(q.transpose(0, 1)[None], k, v, causal=True)
    err = (ours().float() - ref()[0].transpose(0, 1).float()).abs().max().item()
    t_ours, t_sdpa = graph_ms([ours]), graph_ms([ref])
    tflop = 2 * 2 * hq * d * tokens * tokens / 2 / 1e12
    gbytes = pool.numel() * pool.element_size() / 1e9
    return Row(
        "prefill", model, tokens, 1, gbytes, t_ours, t_sdpa, backend,
        tflop / t_ours * 1e3, tflop / t_sdpa * 1e3, None, err,
    )  # fmt: skip


def jobs(max_gb: float) -> list[tuple]:
    out: list[tuple] = []
    for model, (d, _, h_kv) in MODELS.items():
        for context in CONTEXTS:
            for batch in BATCHES:
                if batch * context * h_kv * d * 2 * DTYPE.itemsize <= max_gb * 1e9:
                    out.append(("decode", model, context, batch))
        out += [("prefill", model, tokens, 1) for tokens in PREFILL_TOKENS]
    return out


def fp8_jobs(max_gb: float) -> list[tuple]:
    """bf16 then fp8 decode of each long-context, batched shape whose bf16 KV fits in max_gb."""
    out: list[tuple] = []
    for model, (d, _, h_kv) in MODELS.items():
        for context in FP8_CONTEXTS:
            for batch in FP8_BATCHES:
                if batch * context * h_kv * d * 2 * DTYPE.itemsize <= max_gb * 1e9:
                    out += [("decode", model, context, batch, kv) for kv in ("bf16", "fp8")]
    return out


def fp8_table(rows: list[Row], copy_gbps: float) -> Table:
    """fp8 against bf16, shape by shape: tokens/s of each and their ratio, each one's share of copy."""
    t = Table(title=f"decode over fp8 KV against bf16 KV, {torch.cuda.get_device_name()}")
    for col in ("model", "context", "batch", "bf16 tok/s", "fp8 tok/s", "fp8/bf16", "bf16/copy", "fp8/copy"):
        t.add_column(col, justify="left" if col == "model" else "right")
    pairs: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        pairs.setdefault((r.model, r.context, r.batch), {})[r.kv] = r
    for (model, context, batch), by in pairs.items():
        if set(by) != {"bf16", "fp8"}:
            continue
        b, f = by["bf16"], by["fp8"]
        ratio, of_copy = f.tokens_per_s / b.tokens_per_s, f.ours_rate / copy_gbps
        t.add_row(
            model, f"{context // 1024}K", str(batch), f"{b.tokens_per_s:,.0f}", f"{f.tokens_per_s:,.0f}",
            f"[{'green' if ratio >= 1.7 else 'red'}]{ratio:.2f}x[/]", f"{b.ours_rate / copy_gbps:.0%}",
            f"[{'green' if of_copy >= 0.85 else 'red'}]{of_copy:.0%}[/]",
        )  # fmt: skip
    return t


def table(rows: list[Row], copy_gbps: float) -> Table:
    t = Table(
        title=f"kvflash kernels on {torch.cuda.get_device_name()}: copy {copy_gbps:,.0f} GB/s (read+write)"
    )
    for col in ("kernel", "model", "KV", "context", "batch", "KV GB", "ours", "SDPA", "backend", "ours/SDPA"):
        t.add_column(col, justify="left" if col in ("kernel", "model", "backend") else "right")
    t.add_column("ours/copy", justify="right")
    t.add_column("read limit/copy", justify="right")
    t.add_column("ours/read limit", justify="right")
    t.add_column("max err", justify="right")
    for r in rows:
        unit = "GB/s" if r.kernel == "decode" else "TFLOP/s"
        vs_sdpa = r.ours_rate / r.sdpa_rate
        good = vs_sdpa >= (1.0 if r.kernel == "decode" else 0.8)
        of_copy = "" if r.of_copy is None else f"{r.of_copy:.0%}"
        if r.of_copy is not None and r.context >= LONG_CONTEXT:
            of_copy = f"[{'green' if r.of_copy >= 0.85 else 'red'}]{of_copy}[/]"
        t.add_row(
            r.kernel, r.model, r.kv, f"{r.context // 1024}K", str(r.batch), f"{r.gbytes:.2f}",
            f"{r.ours_rate:,.0f} {unit}", f"{r.sdpa_rate:,.0f} {unit}", r.sdpa_backend,
            f"[{'green' if good else 'red'}]{vs_sdpa:.2f}[/]", of_copy,
            "" if r.read_rate is None else f"{r.read_rate / copy_gbps:.0%}",
            "" if r.read_rate is None else f"{r.ours_rate / r.read_rate:.0%}",
            f"{r.max_err:.1e}",
        )  # fmt: skip
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON results")
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip decode shapes with more KV than this")
    ap.add_argument("--fp8", action="store_true", help="decode over fp8 KV against bf16 KV, nothing else")
    args = ap.parse_args()
    require_cuda("kernel_speed", "CUDA kernels")
    console = Console(width=None if Console().is_terminal else 160)
    todo = fp8_jobs(args.max_gb) if args.fp8 else [(*job, "bf16") for job in jobs(args.max_gb)]
    rows: list[Row] = []
    with progress_bar(console=console, transient=True) as progress:
        task = progress.add_task("copy bandwidth", total=len(todo) + 1)
        copy_gbps = copy_bandwidth()
        progress.advance(task)
        for kind, model, context, batch, kv in todo:
            progress.update(task, description=f"{kind} {model} {kv} {context // 1024}K x{batch}")
            if kind == "decode":
                rows.append(bench_decode(model, context, batch, copy_gbps, kv))
            else:
                rows.append(bench_prefill(model, context))
            settle()
            progress.advance(task)
    console.print(table(rows, copy_gbps))
    if args.fp8:
        console.print(fp8_table(rows, copy_gbps))
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "chunk_tokens": CHUNK,
        "dtype": str(DTYPE),
        "copy_gbps": copy_gbps,
    }
    write_json(args.out, {**meta, "rows": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in rows]})
    png = str(args.out).removesuffix(".json") + ".png"
    plot_decode([asdict(r) for r in rows], copy_gbps, png)
    console.print(f"wrote {args.out} and {png}")


def plot_decode(rows: list[dict], copy_gbps: float, path: str) -> None:
    """Decode as a share of the copy rate against context, one line per batch, per model, with the
    read limit of batch 1 (dashed) and the 85 % target."""
    plt = pyplot()

    models = list(MODELS)
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), sharey=True)
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in rows if r["kernel"] == "decode" and r["model"] == model]
        for batch, kv in sorted({(r["batch"], r["kv"]) for r in mine}):
            pts = sorted(
                (r["context"], 100 * r["ours_rate"] / copy_gbps, 100 * r["read_rate"] / copy_gbps)
                for r in mine
                if (r["batch"], r["kv"]) == (batch, kv)
            )
            label = f"batch {batch}" + ("" if kv == "bf16" else f", {kv}")
            line = ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], "o-" if kv == "bf16" else "s--", label=label
            )
            if batch == 1:
                color = line[0].get_color()
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=color, label="read limit, b1")
        ax.axhline(85, color="grey", lw=0.8, ls=":")
        ax.axvline(LONG_CONTEXT, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(model)
        ax.set_xlabel("context (tokens)")
        ax.legend(fontsize=7)  # each model's own lines: their shapes differ
    axes[0].set_ylabel("% of copy bandwidth")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
