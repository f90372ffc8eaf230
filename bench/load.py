"""Model load time: the default model through `load_model`, phase by phase, in this process and in a
new one, and a random-weight GGUF of Llama-3-8B's shape in Q4_K_M dequantised into bf16 on the device.

Phases are the calls `load_model` makes, timed one by one (median of --repeats): opening the GGUF
(memory map, metadata, tensor infos), dequantising every tensor on the device, building the module,
the tokenizer from the GGUF's vocab (and, for comparison, from the same tokenizer saved as
tokenizer.json), and the weights' identity for the fingerprint on a first start (hashing the file) and
on later ones (the record). "new process" runs `load_model` in a fresh interpreter (the file is in the
page cache): its wall time covers the interpreter, importing torch and kvflash, the device's first
work any CUDA program pays (the context, the first cuBLAS call; timed apart), and the load.

The 8B file is written by this script with the `gguf` writer, tensor by tensor, as llama.cpp's Q4_K_M
mix lays it out (Q6_K for the output head and for attn_v and ffn_down in the layers llama.cpp gives
more bits, Q4_K elsewhere, norms F32); the `gguf` package cannot quantise k-quants, so its blocks are
random valid ones. Its dequantisation is reported as GB/s of file size into bf16 on the device, each
tensor dropped once made (an 8B model in bf16 is 16 GB). The file is ~4.9 GB and is deleted after.

  python -m bench.load --device cuda --out out/load
  python -m bench.load --device cpu --no-8b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from bench.harness import LLAMA_8B, bars, out_dir, save
from kvflash.config import ModelConfig
from kvflash.models.dequant import TYPES, random_blocks
from kvflash.models.fetch import default_model_path
from kvflash.models.fingerprint import weights_identity
from kvflash.models.gguf_loader import GGUFModel
from kvflash.models.loader import build_model, default_dtype, load_model
from kvflash.models.tokenizer import Tokenizer

Q4_K, Q6_K, F32 = (
    gguf.GGMLQuantizationType.Q4_K,
    gguf.GGMLQuantizationType.Q6_K,
    gguf.GGMLQuantizationType.F32,
)

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from kvflash.models.loader import load_model
t1 = time.perf_counter()
cuda = sys.argv[2] == "cuda"
if cuda:  # what any CUDA program pays first, apart from the load: the context, then cuBLAS
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
t_ctx = time.perf_counter()
if cuda:
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
t_blas = time.perf_counter()
lm = load_model(sys.argv[1], device=sys.argv[2])
if cuda:
    torch.cuda.synchronize()
t2 = time.perf_counter()
lm.fingerprint(64, lm.dtype)
print(json.dumps({"imports": t1 - t0, "cuda_context": t_ctx - t1, "cublas": t_blas - t_ctx,
                  "load_model": t2 - t_blas, "fingerprint": time.perf_counter() - t2}))
"""


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    return statistics.median(timed(fn, device)[0] for _ in range(repeats))


def fingerprint_times(path: Path) -> tuple[float, float]:
    """The weights' identity on a first start (no record: the file is hashed) and on the next."""
    with tempfile.TemporaryDirectory() as home:
        old = os.environ.get("KVFLASH_HOME")
        os.environ["KVFLASH_HOME"] = home
        try:
            first = timed(lambda: weights_identity([path]), torch.device("cpu"))[0]
            again = timed(lambda: weights_identity([path]), torch.device("cpu"))[0]
        finally:
            if old is None:
                del os.environ["KVFLASH_HOME"]
            else:
                os.environ["KVFLASH_HOME"] = old
    return first, again


def default_model_rows(path: Path, device: torch.device, repeats: int) -> list[dict]:
    dtype = default_dtype(device)
    rows: list[tuple[str, float]] = []
    load_model(path, device=device)  # warm-up: first CUDA context, kernels, page cache
    rows.append(("load_model (warm)", median_time(lambda: load_model(path, device=device), device, repeats)))
    rows.append(("  open GGUF", median_time(lambda: GGUFModel(path), device, repeats)))
    model = GGUFModel(path)
    rows.append(("  dequantise", median_time(lambda: dict(model.weights(device, dtype)), device, repeats)))
    weights = dict(model.weights(device, dtype))
    build = median_time(lambda: build_model(model.config, dict(weights), dtype, device), device, repeats)
    rows.append(("  build module", build))
    rows.append(
        ("  tokenizer (from vocab)", median_time(lambda: Tokenizer.from_gguf(model.meta()), device, repeats))
    )
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "tokenizer.json"
        Tokenizer.from_gguf(model.meta()).hf.save(str(saved))
        from tokenizers import Tokenizer as HFTokenizer

        from_json = median_time(lambda: HFTokenizer.from_file(str(saved)), device, repeats)
        rows.append(("  (tokenizer.json instead)", from_json))
    first, again = fingerprint_times(path)
    rows += [("fingerprint, first start", first), ("fingerprint, later starts", again)]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), device.type], capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the new process failed:\n{proc.stderr}")
    child = json.loads(proc.stdout.splitlines()[-1])
    rows += [
        ("new process: wall", wall),
        ("  imports (torch, kvflash)", child["imports"]),
        ("  CUDA context", child["cuda_context"]),
        ("  first cuBLAS call", child["cublas"]),
        ("  load_model", child["load_model"]),
        ("  fingerprint", child["fingerprint"]),
    ]
    size = path.stat().st_size
    dequant = next(s for p, s in rows if p == "  dequantise")
    return [
        {
            "model": path.name,
            "phase": p,
            "seconds": s,
            "gb_s": size / dequant / 1e9 if p == "  dequantise" else None,
        }
        for p, s in rows
    ]


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M stores as Q6_K."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def q4_k_m_tensors(
    cfg: ModelConfig,
) -> list[tuple[str, tuple[int, int] | tuple[int], gguf.GGMLQuantizationType]]:
    """(name, HF shape, type) in llama.cpp's order for a Q4_K_M file of this shape."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = [("token_embd.weight", (cfg.vocab_size, h), Q4_K)]
    for i in range(cfg.n_layers):
        wide = Q6_K if more_bits(i, cfg.n_layers) else Q4_K
        out += [
            (f"blk.{i}.attn_norm.weight", (h,), F32),
            (f"blk.{i}.attn_q.weight", (cfg.n_heads * d, h), Q4_K),
            (f"blk.{i}.attn_k.weight", (cfg.n_kv_heads * d, h), Q4_K),
            (f"blk.{i}.attn_v.weight", (cfg.n_kv_heads * d, h), wide),
            (f"blk.{i}.attn_output.weight", (h, cfg.n_heads * d), Q4_K),
            (f"blk.{i}.ffn_norm.weight", (h,), F32),
            (f"blk.{i}.ffn_gate.weight", (f, h), Q4_K),
            (f"blk.{i}.ffn_up.weight", (f, h), Q4_K),
            (f"blk.{i}.ffn_down.weight", (h, f), wide),
        ]
    return out + [("output_norm.weight", (h,), F32), ("output.weight", (cfg.vocab_size, h), Q6_K)]


def write_q4_k_m(path: Path, cfg: ModelConfig, console: Console) -> None:
    """A random-weight GGUF of this shape, written tensor by tensor (never all in memory)."""
    w = gguf.GGUFWriter(path, cfg.arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
    w.add_token_types([1] * cfg.vocab_size)
    tensors = q4_k_m_tensors(cfg)
    for name, shape, kind in tensors:
        t = TYPES[kind.value]
        nbytes = t.nbytes(int(np.prod(shape)))
        w.add_tensor_info(
            name, (shape[0], nbytes // shape[0]) if len(shape) == 2 else (nbytes,), np.uint8, nbytes, kind
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    with console.status(f"writing {path.name}"):
        for _, shape, kind in tensors:
            t = TYPES[kind.value]
            w.write_tensor_data(random_blocks(t, int(np.prod(shape)) // t.block_size, rng).reshape(-1))
    w.close()


def llama8b_rows(path: Path, device: torch.device, console: Console) -> list[dict]:
    t0 = time.perf_counter()
    write_q4_k_m(path, LLAMA_8B, console)
    written, size = time.perf_counter() - t0, path.stat().st_size
    console.print(f"wrote {path} ({size / 1e9:.2f} GB) in {written:.0f} s")
    opened, model = timed(lambda: GGUFModel(path), device)

    def dequantise() -> None:
        for _ in model.weights(device, torch.bfloat16):
            pass

    with console.status("dequantising the 8B file"):
        dequantise()  # the first pass reads the file into the page cache
        seconds = timed(dequantise, device)[0]
    first, again = fingerprint_times(path)
    name = f"Llama-3-8B shape Q4_K_M ({size / 1e9:.2f} GB)"
    return [
        {"model": name, "phase": "open GGUF", "seconds": opened, "gb_s": None},
        {"model": name, "phase": "dequantise into bf16", "seconds": seconds, "gb_s": size / seconds / 1e9},
        {"model": name, "phase": "fingerprint, first start", "seconds": first, "gb_s": None},
        {"model": name, "phase": "fingerprint, later starts", "seconds": again, "gb_s": None},
    ]


def table(rows: list[dict], device: str) -> Table:
    t = Table(title=f"model load on {device}")
    for col in ("model", "phase", "seconds", "GB/s file -> device"):
        t.add_column(col, justify="left" if col in ("model", "phase") else "right")
    last = None
    for r in rows:
        gb = "" if r["gb_s"] is None else f"{r['gb_s']:.2f}"
        t.add_row(r["model"] if r["model"] != last else "", r["phase"], f"{r['seconds']:.3f}", gb)
        last = r["model"]
    return t


def plot(rows: list[dict], path: Path) -> None:
    title = f"model load phases ({rows[0]['device']})"
    group = lambda r: f"{r['model'].split(' (')[0][:18]}\n{r['phase'].strip()[:22]}"  # noqa: E731
    bars(rows, [("seconds", "seconds", None)], "seconds (log)", title, path, group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--model-path", default=None, help="GGUF (default: the pulled default model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-8b", action="store_true", help="skip the 8B file")
    ap.add_argument("--workdir", default=None, help="where the 8B file is written (default: a temp dir)")
    ap.add_argument("--out", default="out/load")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    device, console = torch.device(args.device), Console()
    path = Path(args.model_path) if args.model_path else default_model_path(fetch=True)
    rows = default_model_rows(path, device, args.repeats)
    if not args.no_8b:
        with tempfile.TemporaryDirectory(dir=args.workdir, prefix="kvflash-load-") as tmp:
            if shutil.disk_usage(tmp).free < 6e9:
                raise SystemExit(f"{tmp}: the 8B file needs ~5 GB of free disk; give --workdir or --no-8b")
            rows += llama8b_rows(Path(tmp) / "llama-3-8b-shape.Q4_K_M.gguf", device, console)
    for r in rows:
        r["device"] = args.device
    console.print(table(rows, args.device))
    out = out_dir(args.out)
    save(console, out / "load", rows, plot, args)


if __name__ == "__main__":
    main()
