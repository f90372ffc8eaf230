"""Checks of sizes the user asks for, made before anything that size is allocated."""

from __future__ import annotations

import os

import torch

from kvflash import KVFlashError
from kvflash.config import resolve_kv_dtype
from kvflash.engine.pool import chunk_bytes, slots_for


def free_memory(device: torch.device) -> int:
    """Bytes free now on the device (CUDA) or in host memory (MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(
    lm, budget: int | str, chunk_tokens: int, kv_dtype: str, asked: str | None = None
) -> None:
    """Refuses a pool budget whose pool alone (of KV in kv_dtype, an `EngineConfig.kv_dtype`)
    exceeds the free memory of its device; `asked` says what set the budget (--pool-tokens where
    not given)."""
    if budget == "auto":
        return
    dtype = resolve_kv_dtype(kv_dtype, lm.dtype, lm.device)
    need = slots_for(lm.config, budget, chunk_tokens, dtype, lm.device) * chunk_bytes(
        lm.config, chunk_tokens, dtype
    )
    free = free_memory(lm.device)
    if need > free:
        raise KVFlashError(
            f"{asked or f'--pool-tokens {budget}'}: the pool needs {need / 2**30:,.1f} GiB, "
            f"{lm.device.type} has {free / 2**30:,.1f} GiB free"
        )
