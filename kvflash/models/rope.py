"""Rotary position embeddings, with the `linear` and `llama3` scalings that HF configs use.

We rotate halves (HF's `rotate_half` convention); the GGUF loader undoes llama.cpp's row permutation
so that both weight sources meet this one convention.
"""

from __future__ import annotations

import math

import torch

from kvflash.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in fp32, after any scaling; computed on the host
    whatever the default device (a meta-device build would run them through Python decompositions,
    importing torch._dynamo), then moved with the module."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    s = cfg.rope_scaling
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    elif s.kind != "default":
        from kvflash import KVFlashError

        raise KVFlashError(f"unsupported rope_scaling type {s.kind!r}")
    return inv.to(torch.float32)


class Rotary(torch.nn.Module):
    """Computes cos/sin for explicit positions, so chunks can be placed at any logical offset."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]. Computed in fp32, returned in x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)
