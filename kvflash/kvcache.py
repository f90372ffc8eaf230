"""The one interface through which the model's attention reads and writes KV.

The forward hands each layer's post-RoPE K/V for the step's tokens to `attend`, which stores them and
returns the attention output. Whoever implements it decides where KV lives (a contiguous buffer
here, the chunk pool later); the model never indexes KV itself.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvflash import KVFlashError
from kvflash.config import ModelConfig


class KVCache(Protocol):
    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Called once per forward with the step's token ids and positions [T] (consecutive, one sequence)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] post-RoPE; stores k/v, returns attention output [T, Hq, D]."""

    def end(self) -> None:
        """Called once per forward after the last layer."""


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [T, Hq, D] over keys/values [Hkv, N, D] (GQA), boolean mask [T, N] -> [T, Hq, D]."""
    q4, k4, v4 = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class ContiguousKV:
    """One sequence's KV in a dense `[n_layers, 2, Hkv, capacity, D]` buffer; the dense reference."""

    def __init__(self, cfg: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.capacity = capacity
        self.buf = torch.zeros(
            cfg.n_layers, 2, cfg.n_kv_heads, capacity, cfg.head_dim, dtype=dtype, device=device
        )
        self.length = 0
        self._start = 0
        self._end = 0
        self._mask: torch.Tensor | None = None

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        start, t = int(positions[0]), positions.numel()
        if start != self.length:
            raise KVFlashError(f"positions start at {start} but the cache holds {self.length} tokens")
        if start + t > self.capacity:
            raise KVFlashError(f"context of {start + t} tokens exceeds the cache capacity {self.capacity}")
        self._start, self._end = start, start + t
        q_pos = torch.arange(start, start + t, device=self.buf.device)
        k_pos = torch.arange(0, start + t, device=self.buf.device)
        self._mask = k_pos[None, :] <= q_pos[:, None] if t > 1 else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.buf[layer]
        kv[0, :, self._start : self._end] = k.transpose(0, 1)
        kv[1, :, self._start : self._end] = v.transpose(0, 1)
        return sdpa(q, kv[0, :, : self._end], kv[1, :, : self._end], self._mask)

    def end(self) -> None:
        self.length = self._end
