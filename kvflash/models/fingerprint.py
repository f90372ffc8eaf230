"""The model fingerprint: KV made under one fingerprint is never restored under another."""

from __future__ import annotations

import hashlib
import json

import torch

from kvflash.config import ModelConfig


def model_fingerprint(cfg: ModelConfig, weights_id: str, kv_dtype: torch.dtype, chunk_tokens: int) -> str:
    """Hash of architecture (RoPE parameters included), weights identity, KV dtype and chunk size."""
    payload = {
        "config": cfg.to_dict(),
        "weights": weights_id,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "chunk_tokens": chunk_tokens,
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]
