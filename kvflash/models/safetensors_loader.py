"""Loads an HF model directory: `config.json` plus `*.safetensors` (safetensors never runs code)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvflash import KVFlashError
from kvflash.config import ModelConfig, RopeScaling


def config_from_hf(d: dict) -> ModelConfig:
    """Maps an HF `config.json` dict (transformers 4.x or 5.x spelling) to a ModelConfig; KVFlashError
    for one that does not describe a model (a field missing or of the wrong type)."""
    try:
        return _config(d)
    except KeyError as e:
        raise KVFlashError(f"config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise KVFlashError(f"config.json does not describe a model ({type(e).__name__}: {e})") from None


def _config(d: dict) -> ModelConfig:
    if not isinstance(d, dict):
        raise TypeError(f"a JSON {type(d).__name__}, not an object")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key in d and type(d[key]) is not int:
            raise TypeError(f"{key} {d[key]!r} is not an integer")
    arch = d.get("model_type", "")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    scaling = RopeScaling(
        kind=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
    )
    heads = d["num_attention_heads"]
    return ModelConfig(
        arch=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        max_position=int(d.get("max_position_embeddings", 8192)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(d.get("attention_bias", False)),
        qk_norm=arch == "qwen3",
    )


def load_safetensors_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise KVFlashError(f"{path}: no config.json (expected an HF model directory)")
    try:
        cfg = config_from_hf(json.loads(cfg_file.read_text(encoding="utf-8")))
    except json.JSONDecodeError as e:
        raise KVFlashError(f"{cfg_file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise KVFlashError(f"{cfg_file}: not UTF-8 text") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise KVFlashError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    weights[name] = st.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise KVFlashError(f"{f}: not a readable safetensors file ({e})") from None
    return cfg, weights
