"""Loads a GGUF file into fp32 tensors under HF names, plus the config and tokenizer metadata.

GGUF (llama.cpp) stores Llama/Mistral Q and K rows permuted for interleaved RoPE; we undo that so one
rotate-half RoPE serves both GGUF and safetensors weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from kvflash import KVFlashError
from kvflash.config import ModelConfig, RopeScaling

PERMUTED_QK_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_REQUIRED_LAYER_PARTS = [v for k, v in _LAYER_NAMES.items() if k not in ("attn_q_norm", "attn_k_norm")]
_ROPE_FREQS = "rope_freqs.weight"
_UNSET: Any = object()


@dataclass(frozen=True)
class GGUFMeta:
    """What the tokenizer needs, taken from the GGUF's `tokenizer.*` keys."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    tokenizer_model: str
    pre: str | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


class _Reader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap.

    numpy.memmap's per-slice bookkeeping makes the reader's ~150k small reads (one per vocab string)
    take ~4.5 s; over a plain view of the same mapping they take ~1 s.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFMeta]:
    """Config, fp32 weights under HF names and shapes, and tokenizer metadata of one GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise KVFlashError(f"model not found: {path}")
    try:
        reader = _Reader(path)
    except Exception as e:  # the reader raises assorted errors on foreign or truncated bytes
        raise KVFlashError(f"{path} is not a readable GGUF file ({_one_line(e)})") from e
    try:
        return _convert(reader, path)
    except (TypeError, ValueError) as e:  # metadata or shapes that do not fit a Llama-family model
        raise KVFlashError(f"{path.name}: unsupported GGUF contents ({_one_line(e)})") from e


def _convert(reader: GGUFReader, path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFMeta]:
    fields = {name: f.contents() for name, f in reader.fields.items() if f.types}
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(fields, tensors, path)
    weights = {}
    for name, t in tensors.items():
        if name == _ROPE_FREQS:
            continue
        w = _to_numpy(t, path)
        if cfg.arch in PERMUTED_QK_ARCHS:
            w = _maybe_unpermute(name, w, cfg)
        weights[_hf_name(name, path)] = torch.from_numpy(w)
    _check_complete(weights, cfg, path)
    return cfg, weights, _meta(fields, path)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [h, d/2, 2] back to HF's [h, 2, d/2] per head."""
    head_dim = w.shape[0] // n_heads
    return np.ascontiguousarray(
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _get(fields: dict[str, Any], key: str, path: Path, default: Any = _UNSET) -> Any:
    if key in fields:
        return fields[key]
    if default is _UNSET:
        raise KVFlashError(f"{path.name}: GGUF metadata lacks {key!r}")
    return default


def _f32(x: float) -> float:
    """Shortest decimal of a float32 value, so 1e-5 reads back as 1e-5 and not 9.99999974e-06."""
    return float(str(np.float32(x)))


def _config(fields: dict[str, Any], tensors: dict[str, Any], path: Path) -> ModelConfig:
    arch = _get(fields, "general.architecture", path)

    def get(key: str, default: Any = _UNSET) -> Any:
        return _get(fields, f"{arch}.{key}", path, default)

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    cfg = ModelConfig(
        arch=arch,
        vocab_size=len(_get(fields, "tokenizer.ggml.tokens", path)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", hidden // n_heads)),
        rms_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(get, path),
        max_position=int(get("context_length")),
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    if _ROPE_FREQS in tensors:
        cfg = _with_llama3_scaling(cfg, tensors[_ROPE_FREQS], path)
    return cfg


def _rope_scaling(get: Any, path: Path) -> RopeScaling:
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        return RopeScaling(kind="linear", factor=_f32(get("rope.scaling.factor")))
    if kind != "none":
        raise KVFlashError(f"{path.name}: unsupported RoPE scaling {kind!r} (supported: linear, llama3)")
    return RopeScaling()


def _with_llama3_scaling(cfg: ModelConfig, t: Any, path: Path) -> ModelConfig:
    """Llama 3.1+ GGUFs carry the llama3 scaling only as per-frequency divisors (`rope_freqs`).

    We take the factor from them, assume Meta's published low/high factors and original context, and
    accept that only if it reproduces every stored divisor.
    """
    from kvflash.models.rope import inv_frequencies

    stored = torch.from_numpy(_to_numpy(t, path).ravel())
    scaled = replace(cfg, rope_scaling=RopeScaling(kind="llama3", factor=float(stored.max())))
    divisors = inv_frequencies(cfg) / inv_frequencies(scaled)
    if divisors.shape != stored.shape or not torch.allclose(divisors, stored, rtol=1e-3):
        raise KVFlashError(f"{path.name}: rope_freqs does not match a llama3 RoPE scaling we can reproduce")
    return scaled


def _to_numpy(t: Any, path: Path) -> np.ndarray:
    """fp32, writable, in HF (numpy) order: GGUF lists dims innermost first, so they are reversed."""
    try:
        w = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise KVFlashError(f"{path.name}: cannot dequantize {t.name} ({t.tensor_type.name})") from e
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    if w.dtype != np.float32 or not w.flags.writeable:
        w = np.array(w, dtype=np.float32)
    return w


def _maybe_unpermute(name: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    if ".attn_q." in name:
        return unpermute_qk(w, cfg.n_heads)
    if ".attn_k." in name:
        return unpermute_qk(w, cfg.n_kv_heads)
    return w


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise KVFlashError(f"{path.name}: unexpected tensor {name!r} for a Llama-family model")


def _check_complete(weights: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight" for i in range(cfg.n_layers) for part in _REQUIRED_LAYER_PARTS
    ]
    missing = [n for n in expected if n not in weights]
    if missing:
        raise KVFlashError(f"{path.name}: missing {len(missing)} tensors, first {missing[0]!r}")


def _meta(fields: dict[str, Any], path: Path) -> GGUFMeta:
    tokens = _get(fields, "tokenizer.ggml.tokens", path)
    token_types = [int(x) for x in fields.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    if len(token_types) != len(tokens):
        raise KVFlashError(f"{path.name}: {len(tokens)} tokens but {len(token_types)} token types")
    return GGUFMeta(
        tokens=tokens,
        token_types=token_types,
        merges=fields.get("tokenizer.ggml.merges", []),
        tokenizer_model=_get(fields, "tokenizer.ggml.model", path),
        pre=fields.get("tokenizer.ggml.pre"),
        bos_id=_opt_int(fields.get("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(fields.get("tokenizer.ggml.eos_token_id")),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)
