"""Tiny random-weight models for unit tests."""

from __future__ import annotations

import torch

from kvflash.config import ModelConfig
from kvflash.models.llama import LlamaForCausalLM


def tiny_config(**over) -> ModelConfig:
    base = dict(
        arch="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
    )
    return ModelConfig(**{**base, **over})


def tiny_model(cfg: ModelConfig | None = None, seed: int = 0) -> LlamaForCausalLM:
    cfg = cfg or tiny_config()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model
