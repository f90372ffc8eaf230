"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import typer

ModelOpt = typer.Option(
    None, "--model", "-m", help="GGUF file or HF safetensors directory (default: SmolLM2-135M-Instruct)."
)
DtypeOpt = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU).")
DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available).")
StoreOpt = typer.Option(None, "--store", help="Snapshot store directory (default: $KVFLASH_HOME/snapshots).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of text.")
