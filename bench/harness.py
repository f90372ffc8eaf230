"""What the benchmark scripts share: the output folder and its JSON and PNG files, the CUDA check,
the progress display, the device copy bandwidth (the memory yardstick), random-weight models of
real shapes, filler prose of a token count, a free port for a `kvflash serve` and the wait until it
answers, and label formats.

torch, triton and matplotlib are imported by the functions that need them, so a script that needs
none of them (`python -m bench.niah_table`) starts without them.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from kvflash.eval.niah_report import fmt_length


def out_dir(path: str | Path) -> Path:
    """The folder a run writes into, made if missing."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: str | Path, body: Any, indent: int = 1, **dumps) -> Path:
    """`body` as JSON at `path`, its folder made if missing (keyword arguments go to `json.dumps`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=indent, **dumps))
    return path


def require_cuda(script: str, what: str) -> None:
    """Stops a GPU benchmark on a machine without CUDA, with one line that says so."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"python -m bench.{script} measures {what}; no CUDA device here")


def progress_bar(console: Console | None = None, transient: bool = False) -> Progress:
    """The progress display every script uses (a context manager)."""
    return Progress(console=console, transient=transient)


def run_meta(**meta) -> dict:
    """Where and when a run happened: device, host, versions, date, and `meta`."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        **meta,
    }


def save(console: Console, stem: Path, rows: list[dict], plot_rows, args, **meta) -> None:
    """Writes stem.json (the rows and the run: device, versions, date, arguments, `meta`) and the
    plot_rows(rows, path) picture as stem.png."""
    run = {**run_meta(**meta), "args": vars(args)}
    json_path, png = stem.with_suffix(".json"), stem.with_suffix(".png")
    write_json(json_path, {"meta": run, "rows": rows})
    plot_rows(rows, png)
    console.print(f"wrote {json_path} and {png}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path) -> None:
    """A figure as the PNG every script writes (120 dpi)."""
    fig.savefig(path, dpi=120)


def bars(
    rows: list[dict],
    series: list[tuple[str, str, str | None]],
    ylabel: str,
    title: str,
    path: Path,
    group: Callable[[dict], str] = lambda r: f"{r['model']}\n{fmt_length(r['context'])}",
) -> None:
    """One group of bars per row (named by `group`, by default model and context), one bar per
    (label, row key, colour) series, log scale."""
    plt = pyplot()
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
    save_png(fig, path)
    plt.close(fig)


def copy_bandwidth() -> float:
    """GB/s of traffic (read + write) of a 4 GiB device-to-device copy: what the memory sustains,
    the yardstick of every bandwidth-bound result."""
    import torch
    from triton.testing import do_bench

    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=60)
    return 2 * src.numel() / ms / 1e6


@functools.cache
def _model_configs() -> dict:
    from kvflash.config import ModelConfig

    return {
        "LLAMA_8B": ModelConfig(
            arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
            n_heads=32, n_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position=1 << 20,
        ),
        "SMOLLM2": ModelConfig(
            arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
            n_kv_heads=3, head_dim=64, rope_theta=100000.0, max_position=1 << 20, tie_embeddings=True,
        ),
    }  # fmt: skip


def __getattr__(name: str):
    """LLAMA_8B and SMOLLM2: Llama-3-8B's and SmolLM2-135M's shapes, for models with random weights
    (speed does not depend on what the weights say), built on first use so that importing the
    harness needs no torch."""
    configs = _model_configs()
    if name in configs:
        return configs[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def random_model(cfg):
    """A kvflash model of `cfg`'s shape on the GPU, bf16, with random weights."""
    import torch

    from kvflash.models.llama import LlamaForCausalLM
    from kvflash.models.loader import LoadedModel, build_model

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    weights = {k: torch.empty(s, dtype=bf16, device=dev).normal_(0.0, 0.02) for k, s in shapes.items()}
    return LoadedModel(build_model(cfg, weights, bf16, dev), None, cfg, Path("random"), bf16, dev)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now, for a `kvflash serve` to take."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Starts a `kvflash serve` command with its stderr in a temporary file (`server_log`): a pipe
    that nobody reads until the end would block the server once it had written a pipe's worth of
    warnings, and every thread behind that write with it."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, text=True, env=env
    )
    proc.log = log
    return proc


def server_log(proc: subprocess.Popen) -> str:
    """What a server from `spawn_server` has written to stderr so far."""
    proc.log.seek(0)
    return proc.log.read()


def wait_until_serving(proc: subprocess.Popen, url: str, timeout_s: float = 600) -> None:
    """Waits for a server from `spawn_server` to answer /health on url; SystemExit with its stderr
    if it exits first, or (killing it) if it is not up in timeout_s."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kvflash serve failed: {server_log(proc)[-2000:]}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("kvflash serve did not come up") from None
            time.sleep(0.2)


def make_document(n_tokens: int, count, seed: int = 0) -> str:
    """Filler prose of about n_tokens tokens (by the model's tokenizer)."""
    from kvflash.eval.haystack import filler_sentences

    sents = filler_sentences(random.Random(seed))
    parts: list[str] = []
    while True:
        parts.extend(next(sents) for _ in range(200))
        if count(" ".join(parts)) >= n_tokens:
            break
    lo, hi = 1, len(parts)
    while lo < hi:  # the longest prefix of sentences within n_tokens
        mid = (lo + hi + 1) // 2
        if count(" ".join(parts[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(parts[:lo])
