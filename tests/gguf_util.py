"""Writes tiny random-weight GGUF files laid out as llama.cpp's converter lays them out.

Loader tests compare what `load_gguf` returns with the HF-layout weights this module started from.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from tokenizers import pre_tokenizers

from kvflash.models.dequant import TYPES, random_blocks

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
# Byte-level alphabet plus a few merged tokens: enough for a working BPE over any text.
TOKENS = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3

_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
QUANTISED = ("bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
"""Storages the `gguf` package quantises."""
RANDOM_BLOCKS = ("q4_k", "q5_k", "q6_k")
"""Storages it cannot quantise: their weights are random valid blocks, not the seed's weights."""
STORAGES = ("fp32", "fp16", *QUANTISED, *RANDOM_BLOCKS)


@dataclass(frozen=True)
class TinySpec:
    """A small Llama-family shape; qwen2 gets q/k/v biases and qwen3 q/k norms, as the real ones do."""

    arch: str = "llama"
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    tie: bool = False
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 256
    pre: str = "smollm"
    chat_template: str | None = None
    rope_freqs: tuple[float, ...] | None = None  # stored as `rope_freqs.weight`, as for Llama 3.1+

    @property
    def vocab(self) -> int:
        return len(TOKENS)


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (per head: [2, d/2] -> [d/2, 2])."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(
    head_dim: int, theta: float, factor: float, low: float = 1.0, high: float = 4.0, original: int = 8192
) -> tuple[float, ...]:
    """What llama.cpp's converter stores in `rope_freqs` for HF's llama3 RoPE scaling."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def random_weights(spec: TinySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """fp32 weights under HF names and shapes."""
    rng = np.random.default_rng(seed)
    h, d, f = spec.hidden, spec.head_dim, spec.ffn

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(spec.vocab, h), "model.norm.weight": norm(h)}
    if not spec.tie:
        w["lm_head.weight"] = mat(spec.vocab, h)
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(spec.n_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(spec.n_kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(spec.n_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, spec.n_heads * d)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if spec.arch == "qwen2":
            for proj, rows in (
                ("q", spec.n_heads * d),
                ("k", spec.n_kv_heads * d),
                ("v", spec.n_kv_heads * d),
            ):
                w[p + f"self_attn.{proj}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
    return w


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TENSORS[module]}.{kind}"


def write_tiny_gguf(
    path: Path,
    spec: TinySpec = TinySpec(),
    storage: str = "fp32",
    seed: int = 0,
    raw_type_of: dict[str, str] | None = None,
    fields: Callable[[gguf.GGUFWriter], None] | None = None,
    add_bos: bool | None = False,
) -> dict[str, torch.Tensor]:
    """Writes the GGUF; returns the HF-layout fp32 weights `load_gguf` should give back.

    storage: one of STORAGES for the 2-D weights (1-D ones stay fp32, as llama.cpp keeps them); the
    returned weights are the oracle's dequantisation of what was stored, so a correct loader matches
    them exactly. raw_type_of names GGUF tensors stored instead as random bytes of another GGML type.
    `fields` adds metadata of its own to the writer; add_bos None writes no add-BOS flag.
    """
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}; choose one of {STORAGES}")
    weights = random_weights(spec, seed)
    writer = gguf.GGUFWriter(path, spec.arch)
    writer.add_block_count(spec.n_layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.n_heads)
    writer.add_head_count_kv(spec.n_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(TOKENS)
    types = [TOKEN_TYPE_CONTROL if t in SPECIAL_TOKENS else TOKEN_TYPE_NORMAL for t in TOKENS]
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)
    if fields is not None:
        fields(writer)

    expected, rng = {}, np.random.default_rng(seed + 1)
    for name, w in weights.items():
        stored, raw_dtype = w, None
        if w.ndim == 2 and storage == "fp16":
            stored = w.astype(np.float16)
            w = stored.astype(np.float32)
        elif w.ndim == 2 and storage in QUANTISED + RANDOM_BLOCKS:
            raw_dtype = GGMLQuantizationType[storage.upper()]
            if storage in QUANTISED:
                stored = quantize(w, raw_dtype)
            else:
                kind = TYPES[raw_dtype.value]
                n = w.size // kind.block_size
                stored = random_blocks(kind, n, rng).reshape(w.shape[0], -1)
            w = dequantize(stored, raw_dtype).reshape(w.shape)
        if gguf_name(name) in (raw_type_of or {}):
            raw_dtype = GGMLQuantizationType[raw_type_of[gguf_name(name)]]
            block, size = gguf.GGML_QUANT_SIZES[raw_dtype]
            stored = rng.integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
        expected[name] = torch.from_numpy(np.ascontiguousarray(w))
        if spec.arch in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            stored = llamacpp_permute(stored, spec.n_heads if ".q_proj." in name else spec.n_kv_heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(stored), raw_dtype=raw_dtype)
    if spec.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(spec.rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def patch_field(path: Path, key: str, value: bytes) -> None:
    """Overwrites the bytes of metadata `key`'s value (as many as `value` has) in a written GGUF:
    a file another writer made, or damaged, for the loader to refuse."""
    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4  # past the value's type
    data[at : at + len(value)] = value
    path.write_bytes(bytes(data))
