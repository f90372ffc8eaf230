"""Our forward against HF transformers (the oracle) on random-weight configs, prefill plus decode."""

from __future__ import annotations

import json

import pytest
import torch

from kvflash.kvcache import ContiguousKV
from kvflash.models.llama import LlamaForCausalLM, pack_weights
from kvflash.models.loader import load_model
from kvflash.models.safetensors_loader import config_from_hf

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=320,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

CASES = {
    "llama": lambda: transformers.LlamaConfig(**BASE, rope_theta=50000.0),
    "llama-tied": lambda: transformers.LlamaConfig(**BASE, tie_word_embeddings=True),
    "llama3-rope": lambda: transformers.LlamaConfig(
        **BASE,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ),
    "linear-rope": lambda: transformers.LlamaConfig(
        **BASE, rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    ),
    "mistral": lambda: transformers.MistralConfig(**BASE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**BASE),
    "qwen3": lambda: transformers.Qwen3Config(**BASE, head_dim=32),
}

PREFILL, DECODE = 40, 5


def _randomize(model: torch.nn.Module) -> None:
    """HF initialises norms to one and biases to zero; perturb them so they are actually tested."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-4 * scale, f"max abs err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name: str) -> None:
    torch.manual_seed(0)
    hf_cfg = CASES[name]()
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval().float()
    _randomize(hf)
    cfg = config_from_hf(hf_cfg.to_dict())
    assert cfg.arch == hf_cfg.model_type
    ours = LlamaForCausalLM(cfg)
    ours.load_state_dict(pack_weights(hf.state_dict()), strict=True)

    ids = torch.randint(0, cfg.vocab_size, (PREFILL + DECODE,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()

    kv = ContiguousKV(cfg, PREFILL + DECODE, torch.float32, "cpu")
    _assert_close(ours(ids[:PREFILL], torch.arange(PREFILL), kv, all_logits=True), ref[:PREFILL])
    for i in range(PREFILL, PREFILL + DECODE):
        _assert_close(ours(ids[i : i + 1], torch.tensor([i]), kv)[0], ref[i])


def test_safetensors_directory_loads_to_same_logits(tmp_path) -> None:
    torch.manual_seed(0)
    hf_cfg = CASES["qwen2"]()
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval().float()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2"

    loaded = load_model(tmp_path, dtype="fp32", device="cpu", need_tokenizer=False)
    ids = torch.randint(0, hf_cfg.vocab_size, (17,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1].float()
    kv = ContiguousKV(loaded.config, 32, torch.float32, "cpu")
    _assert_close(loaded.model(ids, torch.arange(17), kv)[0], ref)
