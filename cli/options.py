"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import typer

from kvflash.config import EngineConfig

ModelOpt = typer.Option(
    None, "--model", "-m", help="GGUF file or HF safetensors directory (default: SmolLM2-135M-Instruct)."
)
DtypeOpt = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU).")
DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available).")
StoreOpt = typer.Option(None, "--store", help="Snapshot store directory (default: $KVFLASH_HOME/snapshots).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of text.")
HostBytesOpt = typer.Option(
    EngineConfig.host_bytes, "--host-bytes", min=1,
    help="Host memory for KV paged out of the GPU or restored from disk, in bytes (default: 8 GiB).",
)  # fmt: skip
