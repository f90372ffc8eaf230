"""Helpers for the CUDA tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def no_device_waits() -> Iterator[None]:
    """Torch's sync debug mode at "error" for the block: any wait of the host for the stream (a
    blocking copy, a device tensor read or indexed with host values) raises. The work launched
    before the block is waited for first."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
