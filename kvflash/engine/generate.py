"""Prefill and token-by-token decoding over any KVCache, with greedy or nucleus sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvflash.kvcache import KVCache
from kvflash.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy, which is what restore-equals-cold comparisons rely on."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


class Sampler:
    def __init__(self, cfg: Sampling, device: torch.device):
        self.cfg = cfg
        self.gen = torch.Generator(device=device)
        if cfg.seed is not None:
            self.gen.manual_seed(cfg.seed)
        else:
            self.gen.seed()

    @property
    def greedy(self) -> bool:
        return self.cfg.temperature <= 0

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] fp32 -> one token id."""
        if self.greedy:
            return int(logits.argmax())
        # shifted first, in fp64: a tiny temperature sends the other logits to -inf, never to nan
        logits = logits.double()
        probs = torch.softmax((logits - logits.max()) / self.cfg.temperature, dim=-1)
        if self.cfg.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.cfg.top_p
            keep[0] = True  # the likeliest token is always in (a tiny top_p rounds to 0 in fp32)
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self.gen))


def prefill(
    model: LlamaForCausalLM,
    ids: list[int],
    kv: KVCache,
    start: int = 0,
    step_tokens: int = 512,
    on_progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Runs ids (placed at positions start..) in slices of step_tokens; returns the last logits [V]."""
    device = model.lm_head.weight.device
    logits = None
    for lo in range(0, len(ids), step_tokens):
        piece = torch.tensor(ids[lo : lo + step_tokens], device=device)
        pos = torch.arange(start + lo, start + lo + piece.numel(), device=device)
        logits = model(piece, pos, kv)[0]
        if on_progress:
            on_progress(piece.numel())
    assert logits is not None, "prefill needs at least one token"
    return logits


Step = Callable[[int, int], torch.Tensor]
"""One decode step: (token id, its position) -> the logits [V] after it."""


def eager_step(model: LlamaForCausalLM, kv: KVCache) -> Step:
    """A decode step that runs the model's forward on one token, over any KVCache."""
    device = model.lm_head.weight.device

    def step(token: int, position: int) -> torch.Tensor:
        ids, pos = torch.tensor([token], device=device), torch.tensor([position], device=device)
        return model(ids, pos, kv)[0]

    return step


def decode(
    step: Step,
    first_logits: torch.Tensor,
    position: int,
    max_tokens: int,
    sampler: Sampler,
    stop_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yields up to max_tokens ids; a stop id ends the stream and is not yielded. `position` is the
    first generated token's; each step's logits are sampled before the next step runs."""
    logits = first_logits
    for i in range(max_tokens):
        tok = sampler(logits)
        if tok in stop_ids:
            return
        yield tok
        if i + 1 < max_tokens:
            logits = step(tok, position)
            position += 1
