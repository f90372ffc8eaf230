"""A sequence: token ids plus a chunk table (logical chunk index -> where its KV lives, and why)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

UNKNOWN = -1
"""A sequence's id for a token a step took on the device (`BatchKV.begin_decode`) until the host
has read it back (`PagedKV.settle`)."""


@dataclass
class Chunk:
    index: int
    gpu: int | None = None
    host: int | None = None
    disk: str | None = None
    """Chain hash of a stored copy not yet read (lazy restore): fetched through the host tier."""
    sealed: bool = False
    """Full and final: only sealed chunks are summarised, scored, paged out, hashed or stored."""
    key: str | None = None
    """Chain hash of a sealed chunk of exact KV: the name its slots are shared under (None for
    approximate KV, which no other sequence computes the same)."""
    pinned: bool = False
    last_use: int = 0
    score: float = float("-inf")


@dataclass
class Sequence:
    chunk_tokens: int
    tokens: list[int] = field(default_factory=list, repr=False)
    chunks: list[Chunk] = field(default_factory=list, repr=False)
    summaries: torch.Tensor | None = field(default=None, repr=False)
    """[capacity, n_layers, n_kv_heads, summary_blocks, head_dim] fp32: block mean keys of sealed chunks."""

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_sealed(self) -> int:
        return len(self.tokens) // self.chunk_tokens

    def ensure_chunks(self, n_tokens: int) -> None:
        while len(self.chunks) * self.chunk_tokens < n_tokens:
            self.chunks.append(Chunk(len(self.chunks)))

    def set_summary(self, index: int, summary: torch.Tensor) -> None:
        if self.summaries is None or self.summaries.shape[0] <= index:
            cap = max(64, 2 * (index + 1))
            grown = torch.zeros((cap, *summary.shape), dtype=torch.float32, device=summary.device)
            if self.summaries is not None:
                grown[: self.summaries.shape[0]] = self.summaries
            self.summaries = grown
        self.summaries[index] = summary

    def set_summaries(self, summaries: torch.Tensor) -> None:
        """The summaries of chunks 0..n-1 at once (a restore: one host-to-device copy, not n)."""
        self.summaries = summaries.float()

    def trim_summaries(self) -> None:
        """Keeps the summaries of the sealed chunks only, dropping the capacity ahead (`set_summary`
        grows it again): a parked sequence then holds summaries in proportion to its chunks."""
        if self.summaries is not None and self.summaries.shape[0] > self.n_sealed:
            self.summaries = self.summaries[: self.n_sealed].clone()

    def chunk_tokens_of(self, index: int) -> list[int]:
        c = self.chunk_tokens
        return self.tokens[index * c : (index + 1) * c]
