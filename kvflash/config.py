"""Configuration dataclasses shared by the models and the engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from kvflash.policies import POLICIES

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Compute dtypes (`--dtype`), each also a KV dtype."""
KV_DTYPE_NAMES = {**DTYPES, "fp8": torch.float8_e4m3fn}
"""KV dtypes by `--kv-dtype` name: fp8 is e4m3 with one fp32 scale per (chunk, layer, K/V, kv-head)
(kvflash/engine/pool.py: `slot_shape`)."""
KV_DTYPES = ("auto", *KV_DTYPE_NAMES)
"""`EngineConfig.kv_dtype` choices: `auto` or a name of KV_DTYPE_NAMES."""
CACHE_ORDERS = ("document", "score")
"""`ResidencyConfig.cache_order` choices."""


def resolve_kv_dtype(name: str, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype KV is kept in, in every tier. `auto`: bf16 where the model computes in fp32 on the
    CPU (half the bytes in memory and on disk; attention still computes in fp32), else the model's
    own dtype (on CUDA that is already 16-bit, and the kernels read it at full speed). fp8 is never
    chosen by `auto`: it is lossy (docs/BENCHMARKS.md: "fp8 KV")."""
    if name != "auto":
        return KV_DTYPE_NAMES[name]
    return torch.bfloat16 if compute == torch.float32 and device.type == "cpu" else compute


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`: `linear` (divide positions) or `llama3` (frequency-dependent)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder; covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position: int = 8192
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        from kvflash import KVFlashError

        if self.arch not in SUPPORTED_ARCHS:
            raise KVFlashError(f"unknown architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
        )
        if bad := next((f for f in sizes if not getattr(self, f) >= 1), None):
            raise KVFlashError(f"{bad} {getattr(self, bad)}: a model's sizes are at least 1")
        if self.head_dim % 2:
            raise KVFlashError(f"head_dim {self.head_dim}: RoPE turns pairs of dimensions")
        if self.n_heads % self.n_kv_heads:
            raise KVFlashError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * elem

    def n_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.n_heads + 2 * self.n_kv_heads)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + h

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ResidencyConfig:
    """What stays on the GPU for a sequence whose KV is larger than its budget (docs/DESIGN.md: Residency).

    The floor is sinks + tail + pins + 2 chunks: the append head and at least one selected chunk.
    """

    chunk_tokens: int = 64
    sink_chunks: int = 1
    tail_chunks: int = 4
    policy: str = "qk"
    tau: int = 16
    """Decode re-selects every max(tau, history_tokens // tau_history_div) tokens."""
    tau_history_div: int = 45
    score_queries: int = 32
    """The last this-many query tokens of a step score the chunks: enough to cover a question."""
    summary_blocks: int = 4
    """Each chunk is summarised by the mean key of each of this many equal runs of its tokens."""
    cache_positions: bool = True
    """Attend to resident chunks at positions as if the chunks between them and the query were absent
    (StreamingLLM's positions within the cache): a selected far chunk sits just before the resident
    ones after it, instead of at a distance the model rarely bridges with the chunks between gone.
    KV is still stored at its absolute positions; the kernels turn each chunk's keys on the fly."""
    cache_order: str = "document"
    """Where each resident chunk sits among the cache positions (`CachePositions.layout`) where some
    are evicted: `document` in the document's order; `score` lays the chunks before the tail out by
    score, ascending, the sinks among them, so the best-scoring one sits just before the tail, where
    the selection scored it (`CachePositions.candidates`): a larger pool then does not push a far
    chunk the question needs past the distances the model was trained on. Policies that score no
    chunk tie everywhere, and keep the document's order. Not part of the model fingerprint: exact KV
    is computed with nothing evicted, where every chunk keeps its own position under either order."""
    keep_margin: float = 1.0
    """Hysteresis of a document's prefill steps (`residency.select_resident`): a chunk pages in only
    by scoring more than (1 + keep_margin) times the weakest resident chunk it would replace. The
    question's steps (scouts, and the step after them) and decode re-selection select exactly."""
    scout_rounds: int = 2
    """Scout passes over a long prompt's last step before the real one: the first runs on the floor
    alone, each later one with the chunks the previous one chose, whose queries then see them."""
    scout_reads: int = 0
    """Chunks each of a question's scouts reads from the store to score them from their keys (a lazy
    restore's chunks are on disk, scored otherwise from their summaries, which underrate a needle):
    the disk-only chunks whose summaries score highest, up to this many a scout. Each read costs
    what a selected chunk does, and stays in the host tier; 0 reads only the chunks selected."""

    def __post_init__(self) -> None:
        from kvflash import KVFlashError

        if self.policy not in POLICIES:
            raise KVFlashError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.cache_order not in CACHE_ORDERS:
            raise KVFlashError(
                f"unknown cache order {self.cache_order!r}; choose one of {', '.join(CACHE_ORDERS)}"
            )
        if self.cache_order != "document" and not self.cache_positions:
            raise KVFlashError(f"cache order {self.cache_order!r} needs positions within the cache")
        if self.keep_margin < 0:
            raise KVFlashError(f"keep_margin {self.keep_margin} must be non-negative")
        if (
            self.chunk_tokens < 1
            or min(self.sink_chunks, self.tail_chunks, self.scout_rounds, self.scout_reads) < 0
        ):
            raise KVFlashError("chunk_tokens must be positive; sink, tail and scout counts non-negative")
        if self.summary_blocks < 1 or self.chunk_tokens % self.summary_blocks:
            raise KVFlashError(
                f"summary_blocks {self.summary_blocks} must divide chunk_tokens {self.chunk_tokens}"
            )

    def floor_chunks(self, pinned: int = 0) -> int:
        return self.sink_chunks + self.tail_chunks + pinned + 2


@dataclass(frozen=True)
class EngineConfig:
    """Pool and host-tier sizes; `pool_tokens` 'auto' takes free device memory minus a reserve."""

    pool_tokens: int | str = 65536
    host_bytes: int = 8 << 30
    residency: ResidencyConfig = field(default_factory=ResidencyConfig)
    prefill_step_tokens: int | None = None
    """The most tokens a prefill step computes; None: `Engine.step_tokens` picks by device."""
    cuda_graphs: bool = True
    """Decode steps replay a CUDA graph on CUDA (`decode_graph`): a step launches a few hundred small
    kernels, and eager launches from Python cost more than the kernels (docs/BENCHMARKS.md: Decode speed)."""
    kv_dtype: str = "auto"
    """The dtype of KV in the pool, the host tier and snapshots (`resolve_kv_dtype`); the model
    computes in its own, and attention casts K/V to it. Part of the model fingerprint: KV of one
    dtype never restores as another."""

    def __post_init__(self) -> None:
        from kvflash import KVFlashError

        if self.kv_dtype not in KV_DTYPES:
            raise KVFlashError(f"unknown KV dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
