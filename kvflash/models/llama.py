"""Llama-family decoder in plain PyTorch (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

Parameter names follow HuggingFace but for two packed projections (nano-vllm's and vLLM's):
`qkv_proj` holds q, k and v stacked, `gate_up_proj` gate and up, so each is one matrix multiply;
`pack_weights` turns a HuggingFace state dict into this one. Tokens are flattened ([T], one sequence
per forward); attention goes through a `KVCache`, which owns where KV lives. The small ops (RMSNorm
with the residual add, RoPE, SiLU * up) go through `kernels`: one Triton launch each on CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflash import kernels
from kvflash.config import ModelConfig
from kvflash.kvcache import KVCache
from kvflash.models.rope import Rotary

PACKED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
"""Packed projection -> the HuggingFace projections stacked in it (rows, in this order)."""


def pack_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HuggingFace-named state dict with each layer's q/k/v and gate/up stacked into the packed
    projections; other tensors pass through."""
    out = dict(weights)
    for name in weights:
        for packed, parts in PACKED.items():
            module, first = packed.split(".")[0], parts[0]
            head, sep, kind = name.partition(f".{module}.{first}.")
            if not sep:
                continue
            names = [f"{head}.{module}.{p}.{kind}" for p in parts]
            if all(n in out for n in names):
                out[f"{head}.{packed}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused with the norm after it."""
        shape = x.shape
        out, res = kernels.rms_norm(
            x.reshape(-1, shape[-1]), self.weight, self.eps,
            None if residual is None else residual.reshape(-1, shape[-1]),
        )  # fmt: skip
        return out.view(shape), res.view(shape)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.sizes = [cfg.n_heads * d, cfg.n_kv_heads * d, cfg.n_kv_heads * d]
        self.qkv_proj = nn.Linear(h, sum(self.sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps)
            self.k_norm = RMSNorm(d, cfg.rms_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.n_heads, self.head_dim)
        k = k.view(t, self.n_kv_heads, self.head_dim)
        v = v.view(t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q)[0], self.k_norm(k)[0]
        q, k = kernels.rotary_qk(q, k, cos, sin)
        out = kv.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller's next norm adds the two."""
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv), residual)
        return self.mlp(h), residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Weights are always assigned after construction (build_model, tests' random models): an
        # uninitialised table skips nn.init, whose first call imports torch._dynamo at start-up.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache, all_logits: bool = False
    ) -> torch.Tensor:
        """input_ids/positions [T] -> fp32 logits [T, V] (or [1, V] for the last token only)."""
        kv.begin(input_ids, positions)
        logits = self.compute(input_ids, positions, kv, all_logits)
        kv.end()
        return logits

    @torch.inference_mode()
    def compute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        all_logits: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward between `kv.begin` and `kv.end`: device work only, so a CUDA graph can hold it.
        Logits of every row, of `rows` (indices [R]) where given, else of the last row."""
        cos, sin = self.rotary.cos_sin(positions)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, kv)
        if rows is not None:
            x, residual = x[rows], residual[rows]
        elif not all_logits:
            x, residual = x[-1:], residual[-1:]
        return self.lm_head(self.model.norm(x, residual)[0]).float()
