"""`kvflash model pull|info`: fetch the default model and describe any model."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvflash.cli.options import DeviceOpt, DtypeOpt, JsonOpt, KvDtypeOpt, ModelOpt
from kvflash.config import resolve_kv_dtype
from kvflash.models.fetch import default_model_path
from kvflash.models.loader import load_model

app = typer.Typer(help="Fetch and describe models.", no_args_is_help=True)

CHUNK_TOKENS = 64


@app.command()
def pull() -> None:
    """Fetch the default model (SmolLM2-135M-Instruct GGUF) into the user cache, once."""
    path = default_model_path(fetch=True)
    Console(highlight=False).print(f"default model ready: {path}")


@app.command()
def info(
    model: Path = ModelOpt,
    dtype: str = DtypeOpt,
    kv_dtype: str = KvDtypeOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Architecture, size, KV bytes per token, context length and fingerprint of a model."""
    lm = load_model(model, dtype=dtype, device=device or "cpu", need_tokenizer=False)
    kv = resolve_kv_dtype(kv_dtype or "auto", lm.dtype, lm.device)
    c = lm.config
    facts = {
        "path": str(lm.path),
        "architecture": c.arch,
        "parameters": c.n_params(),
        "layers": c.n_layers,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "context_length": c.max_position,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling.kind,
        "kv_dtype": str(kv).removeprefix("torch."),
        "kv_bytes_per_token": c.kv_bytes_per_token(kv),
        "chunk_tokens": CHUNK_TOKENS,
        "fingerprint": lm.fingerprint(CHUNK_TOKENS, kv),
    }
    if as_json:
        print(json.dumps(facts))
        return
    table = Table(show_header=False, box=None)
    for k, v in facts.items():
        table.add_row(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else str(v))
    Console().print(table)
