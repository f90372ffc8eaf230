"""Options shared by several commands, so each is spelled and documented once."""

from __future__ import annotations

import re

import typer


def _device(value: str | None) -> str | None:
    """cpu, cuda or cuda:N, and CUDA only where there is a device: checked before the model loads."""
    if value is None:
        return None
    if not re.fullmatch(r"cpu|cuda(:\d{1,3})?", value):
        raise typer.BadParameter(f"{value!r:.40} is not cpu, cuda or cuda:N")
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise typer.BadParameter("no CUDA device here; use --device cpu")
        if ":" in value and int(value.split(":")[1]) >= torch.cuda.device_count():
            raise typer.BadParameter(f"{value}: this machine has {torch.cuda.device_count()} CUDA devices")
    return value


def _kv_dtype(value: str | None) -> str | None:
    """A KV dtype name (`kvflash.config.KV_DTYPES`), checked before the model loads."""
    if value is None:
        return None
    from kvflash.config import KV_DTYPES

    if value not in KV_DTYPES:
        raise typer.BadParameter(f"{value!r:.40} is not one of {', '.join(KV_DTYPES)}")
    return value


ModelOpt = typer.Option(
    None, "--model", "-m", help="GGUF file or HF safetensors directory (default: SmolLM2-135M-Instruct)."
)
DtypeOpt = typer.Option(None, "--dtype", help="fp32, bf16 or fp16 (default: bf16 on CUDA, fp32 on CPU).")
DeviceOpt = typer.Option(
    None, "--device", callback=_device, help="cpu or cuda (default: cuda when available)."
)
KvDtypeOpt = typer.Option(
    None, "--kv-dtype", callback=_kv_dtype,
    help="KV in memory and snapshots: auto, fp32, bf16, fp16 or fp8 (e4m3, scaled per chunk and head; "
    "default auto: bf16 where the model computes in fp32 on a CPU, else the model's dtype). Snapshots of "
    "another KV dtype are not restored.",
)  # fmt: skip
StoreOpt = typer.Option(None, "--store", help="Snapshot store directory (default: $KVFLASH_HOME/snapshots).")
SharedStoreOpt = typer.Option(
    None, "--shared-store", metavar="URL",
    help="Redis holding a snapshot tier that several servers share: redis://[:PASSWORD@]HOST:PORT/DB.",
)  # fmt: skip
JsonOpt = typer.Option(False, "--json", help="Print one JSON object instead of text.")
HostBytesOpt = typer.Option(
    None, "--host-bytes", min=1,
    help="Host memory for KV paged out of the GPU or restored from disk, in bytes (default: 8 GiB).",
)  # fmt: skip
