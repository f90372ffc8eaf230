"""Loads a GGUF file into tensors under HF names on the target device, plus config and tokenizer metadata.

GGUF (llama.cpp) stores Llama/Mistral Q and K rows permuted for interleaved RoPE; we undo that so one
rotate-half RoPE serves both GGUF and safetensors weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflash import KVFlashError
from kvflash.config import ModelConfig, RopeScaling
from kvflash.models.dequant import dequantize, ggml_type
from kvflash.models.gguf_file import GGUFFile, TensorInfo

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
BOS_BY_DEFAULT = frozenset({"llama-bpe"})
"""Pre-tokenizers whose prompts start with BOS when the file has no `tokenizer.ggml.add_bos_token`:
llama.cpp's default for its Llama 3 group (Llama 3 GGUFs carry no flag); other byte-level BPE
models start without."""
_UNSET: Any = object()


@dataclass(frozen=True)
class GGUFMeta:
    """What the tokenizer needs, taken from the GGUF's `tokenizer.*` keys."""

    tokens: Sequence[str]
    token_types: list[int]
    merges: Sequence[str]
    tokenizer_model: str
    pre: str | None
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


class GGUFModel:
    """An opened GGUF file: config and tokenizer metadata at once, weights on demand, tensor by tensor.

    Every tensor's type and extent is checked on opening, so a file that cannot load fails before
    any weight is dequantised.
    """

    def __init__(self, path: Path):
        self.path = path = Path(path)
        if not path.is_file():
            raise KVFlashError(f"model not found: {path}")
        try:
            self.file = GGUFFile(path)
        except (OSError, ValueError) as e:  # GGUFFormatError is a ValueError
            raise KVFlashError(f"{path} is not a readable GGUF file ({_one_line(e)})") from e
        self.fields = self.file.fields
        self.tensors = {t.name: t for t in self.file.tensors}
        self.kinds = {n: ggml_type(t.type_id, f"{path.name}: tensor {n!r}") for n, t in self.tensors.items()}
        for name, t in self.tensors.items():
            if self.kinds[name].nbytes(_n_elements(t)) + t.offset > self.file.size:
                raise KVFlashError(f"{path} is not a readable GGUF file (tensor {name!r} runs past its end)")
        try:
            self.config = _config(self, path)
        except (TypeError, ValueError) as e:  # metadata or shapes that do not fit a Llama-family model
            raise KVFlashError(f"{path.name}: unsupported GGUF contents ({_one_line(e)})") from e

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the file."""
        return sum(self.kinds[n].nbytes(_n_elements(t)) for n, t in self.tensors.items())

    def meta(self) -> GGUFMeta:
        return _meta(self.fields, self.path)

    def tensor(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """One tensor dequantised on `device`, in HF (row-major) shape: GGUF lists dims innermost first."""
        t, kind = self.tensors[name], self.kinds[name]
        n = _n_elements(t)
        w = dequantize(self.file.raw(t, kind.nbytes(n)), kind, n, device, dtype)
        return w.view(tuple(reversed(t.shape)))

    def weights(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for each weight, Q/K rows un-permuted; on_progress(bytes done, total)."""
        device, total, done = torch.device(device), self.nbytes, 0
        for name, t in self.tensors.items():
            done += self.kinds[name].nbytes(_n_elements(t))
            if name == _ROPE_FREQS:
                continue
            w = self.tensor(name, device, dtype)
            if self.config.arch in PERMUTED_QK_ARCHS:
                w = _maybe_unpermute(name, w, self.config)
            yield _hf_name(name, self.path), w
            if on_progress is not None:
                on_progress(done, total)


def load_gguf(
    path: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFMeta]:
    """Config, weights under HF names and shapes (dequantised on `device` as `dtype`) and tokenizer
    metadata of one GGUF file."""
    model = GGUFModel(path)
    try:
        weights = dict(model.weights(device, dtype, on_progress))
    except ValueError as e:  # a tensor of no elements, or Q/K rows that do not split into heads
        raise KVFlashError(f"{model.path.name}: unsupported GGUF contents ({_one_line(e)})") from e
    _check_complete(weights, model.config, model.path)
    return model.config, weights, model.meta()


def _n_elements(t: TensorInfo) -> int:
    return math.prod(t.shape)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `permute`: rows [h, d/2, 2] back to HF's [h, 2, d/2] per head."""
    head_dim = w.shape[0] // n_heads
    if w.shape[0] != n_heads * head_dim or head_dim % 2:
        raise ValueError(f"{w.shape[0]} Q/K rows do not split into {n_heads} heads of an even size")
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _get(fields: dict[str, Any], key: str, path: Path, default: Any = _UNSET) -> Any:
    if key in fields:
        return fields[key]
    if default is _UNSET:
        raise KVFlashError(f"{path.name}: GGUF metadata lacks {key!r}")
    return default


def _f32(x: float) -> float:
    """Shortest decimal of a float32 value, so 1e-5 reads back as 1e-5 and not 9.99999974e-06."""
    return float(str(np.float32(x)))


def _config(model: GGUFModel, path: Path) -> ModelConfig:
    fields, tensors = model.fields, model.tensors
    arch = _get(fields, "general.architecture", path)

    def get(key: str, default: Any = _UNSET) -> Any:
        return _get(fields, f"{arch}.{key}", path, default)

    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_layers = int(get("block_count"))
    blocks = {n.split(".")[1] for n in tensors if n.startswith("blk.")}
    if len(blocks) != n_layers or blocks != {str(i) for i in range(n_layers)}:  # before it sizes anything
        raise ValueError(f"block_count {n_layers}, but the file has tensors of {len(blocks)} blocks")
    if n_heads < 1:
        raise ValueError(f"attention.head_count {n_heads}")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=len(_get(fields, "tokenizer.ggml.tokens", path)),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        n_layers=n_layers,
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
        cfg = _with_llama3_scaling(cfg, model.tensor(_ROPE_FREQS, torch.device("cpu"), torch.float32), path)
    return cfg


def _rope_scaling(get: Any, path: Path) -> RopeScaling:
    """As llama.cpp reads it: a factor (`rope.scaling.factor`, or the older `rope.scale_linear`)
    without a type is linear."""
    factor = get("rope.scaling.factor", get("rope.scale_linear", None))
    kind = get("rope.scaling.type", "none" if factor in (None, 1.0) else "linear")
    if kind == "linear":
        if factor is None:
            raise ValueError("linear RoPE scaling without a factor")
        return RopeScaling(kind="linear", factor=_f32(factor))
    if kind != "none":
        raise KVFlashError(f"{path.name}: unsupported RoPE scaling {kind!r} (supported: linear, llama3)")
    return RopeScaling()


def _with_llama3_scaling(cfg: ModelConfig, stored: torch.Tensor, path: Path) -> ModelConfig:
    """Llama 3.1+ GGUFs carry the llama3 scaling only as per-frequency divisors (`rope_freqs`).

    We take the factor from them, assume Meta's published low/high factors and original context, and
    accept that only if it reproduces every stored divisor.
    """
    from kvflash.models.rope import inv_frequencies

    stored = stored.ravel()
    scaled = replace(cfg, rope_scaling=RopeScaling(kind="llama3", factor=float(stored.max())))
    divisors = inv_frequencies(cfg) / inv_frequencies(scaled)
    if divisors.shape != stored.shape or not torch.allclose(divisors, stored, rtol=1e-3):
        raise KVFlashError(f"{path.name}: rope_freqs does not match a llama3 RoPE scaling we can reproduce")
    return scaled


def _maybe_unpermute(name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
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
    token_types = np.asarray(fields.get("tokenizer.ggml.token_type", [1] * len(tokens))).tolist()
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
        add_bos=bool(
            fields.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer.ggml.pre") in BOS_BY_DEFAULT)
        ),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)
