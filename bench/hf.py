"""The peer a user would pick instead: HF transformers with the whole KV on the GPU (SDPA).

`hf_llama` builds transformers' Llama of the same shape as a kvflash model, with kvflash's weights
(the packed projections split back), so both compute the same function; `hf_prefill_s` times a cold
prefill of one prompt as `generate` runs it (the whole prompt in one forward, logits of the last
token only).
"""

from __future__ import annotations

import time

import torch

from kvflash.models.llama import PACKED
from kvflash.models.loader import LoadedModel


def _unpacked(lm: LoadedModel) -> dict[str, torch.Tensor]:
    """kvflash's state dict under HF names: each packed projection split into its parts."""
    cfg = lm.config
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    out = {}
    for name, w in lm.model.state_dict().items():
        for packed, parts in PACKED.items():
            head, sep, kind = name.partition(f".{packed}.")
            if sep:
                for part, piece in zip(parts, w.split(sizes[packed]), strict=True):
                    out[f"{head}.{packed.split('.')[0]}.{part}.{kind}"] = piece
                break
        else:
            out[name] = w
    return out


def hf_llama(lm: LoadedModel):
    """transformers' LlamaForCausalLM of lm's shape and dtype on lm's device, holding lm's weights."""
    import transformers

    cfg = lm.config
    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=cfg.qkv_bias,
    )  # fmt: skip
    hc._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hc)
    missing, unexpected = model.load_state_dict(_unpacked(lm), strict=False, assign=True)
    if unexpected or [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]:
        raise RuntimeError(f"HF weights do not line up: missing {missing}, unexpected {unexpected}")
    if cfg.tie_embeddings:
        model.tie_weights()
    with torch.device(lm.device):
        model.model.rotary_emb = type(model.model.rotary_emb)(hc)  # its buffers were on meta
    return model.to(lm.device, lm.dtype).eval()


@torch.inference_mode()
def hf_prefill_s(model, ids: list[int]) -> tuple[float, int]:
    """Seconds of one cold prefill of ids (a new cache, the whole prompt in one forward, the last
    token's logits), and the greedy next token."""
    x = torch.tensor([ids], device=model.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    token = int(out.logits[0, -1].argmax())
    seconds = time.perf_counter() - t0
    del out
    return seconds, token
