"""One entry point that turns a path (GGUF file, HF directory, or nothing for the default) into a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from kvflash import KVFlashError, heap, kernels
from kvflash.config import DTYPES, ModelConfig
from kvflash.models.fingerprint import model_fingerprint, weights_identity
from kvflash.models.llama import LlamaForCausalLM, pack_weights
from kvflash.models.rope import Rotary
from kvflash.models.tokenizer import Tokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where tensor cores make it fast; fp32 on CPU, where bf16 matmuls are slower and less exact."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    path: Path
    dtype: torch.dtype
    device: torch.device

    @cached_property
    def weights_id(self) -> str:
        """sha256 over the weight files' bytes (hashed once per file version): the weights' identity."""
        files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
        return weights_identity(files)

    def fingerprint(self, chunk_tokens: int, kv_dtype: torch.dtype) -> str:
        """The fingerprint of KV in kv_dtype (the engine's, which may differ from the model's dtype)."""
        return model_fingerprint(self.config, self.weights_id, kv_dtype, chunk_tokens)


def build_model(
    cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """Builds without random init (meta device), then adopts the given tensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    weights = {k: v.to(device=device, dtype=dtype) for k, v in pack_weights(weights).items()}
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise KVFlashError(
            f"weights do not fit a {cfg.arch} model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )
    want = model.state_dict()
    if bad := next((k for k, v in weights.items() if v.shape != want[k].shape), None):
        raise KVFlashError(
            f"weights do not fit their {cfg.arch} config: {bad} is {list(weights[bad].shape)}, "
            f"the config needs {list(want[bad].shape)}"
        )
    model.load_state_dict(weights, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg).to(device)
    return model.eval()


def load_model(
    path: Path | str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    need_tokenizer: bool = True,
    fetch: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> LoadedModel:
    """path None means the default model (fetched once into the user cache). A GGUF is dequantised
    on the device, tensor by tensor; on_progress(bytes done, total) follows that."""
    from kvflash.models.fetch import default_model_path

    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        kernels.start_cache_key()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise KVFlashError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dt = dtype or default_dtype(dev)
    p = Path(path) if path is not None else default_model_path(fetch=fetch)
    if not p.exists():
        raise KVFlashError(f"model not found: {p}")
    tokenizer = None
    if p.is_dir():
        from kvflash.models.safetensors_loader import load_safetensors_dir

        cfg, weights = load_safetensors_dir(p)
        if need_tokenizer:
            tokenizer = Tokenizer.from_dir(p)
    else:
        from kvflash.models.gguf_loader import load_gguf

        cfg, weights, meta = load_gguf(p, dev, dt, on_progress)
        if need_tokenizer:
            tokenizer = Tokenizer.from_gguf(meta)
    if tokenizer is not None:
        tokenizer.prepare()
    model = build_model(cfg, weights, dt, dev)
    del weights
    heap.trim()  # the file's buffers and the dequantisation's temporaries are free now
    return LoadedModel(model, tokenizer, cfg, p, dt, dev)
