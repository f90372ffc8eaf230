"""Token-by-token decoding over any KVCache: greedy or nucleus sampling, the per-token rule of an
answer (`Generation`) and the decode loop of one sequence (`decode`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from math import inf

import torch

from kvflash.engine.to_device import on_device
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


Step = Callable[[int, int], torch.Tensor]
"""One decode step: (token id, its position) -> the logits [V] after it."""


def eager_step(model: LlamaForCausalLM, kv: KVCache) -> Step:
    """A decode step that runs the model's forward on one token, over any KVCache."""
    device = model.lm_head.weight.device

    def step(token: int, position: int) -> torch.Tensor:
        ids, pos = on_device([token], torch.long, device), on_device([position], torch.long, device)
        return model(ids, pos, kv)[0]

    return step


class Generation:
    """One answer, a token at a time: `next` is the rule every decode loop runs per token (`decode`
    over one sequence, the scheduler's steps over a batch). It samples each step's logits and ends
    the answer at a stop id, at max_tokens or when `on_token` returns True (a stop string, a client
    gone). Before `min_tokens` tokens no stop id is sampled (a benchmark's answers of a fixed length).
    It times the answer from `t0` (when the request began; now if not given)."""

    def __init__(
        self,
        max_tokens: int,
        sampler: Sampler,
        stop_ids: frozenset[int] = frozenset(),
        on_token: Callable[[int], bool | None] | None = None,
        min_tokens: int = 0,
        t0: float | None = None,
    ):
        self.max_tokens, self.sampler, self.stop_ids = max_tokens, sampler, stop_ids
        self.on_token, self.min_tokens = on_token, min_tokens
        self.t0 = time.perf_counter() if t0 is None else t0
        self.out: list[int] = []
        self.t_first: float | None = None
        """When the first token was sampled."""
        self.t_end: float | None = None
        """When the answer ended (`finish`)."""

    def next(self, logits: torch.Tensor, argmax: int | None = None) -> int | None:
        """The token to feed next (`choose`, then `emit`), or None: the answer has ended."""
        tok = self.choose(logits, argmax)
        return tok if tok is not None and self.emit(tok) else None

    def choose(self, logits: torch.Tensor | None, argmax: int | None = None) -> int | None:
        """The answer's next token, sampled from logits [V] (a greedy answer takes `argmax` where the
        caller has it, read back for a whole batch at once, or chosen on the device by
        `greedy_tokens`, when logits may be None), or None: a stop id ended the answer (it is not
        kept). The answer does not have it until `emit`."""
        greedy = argmax is not None and self.sampler.greedy
        if self.holds_stops and not (greedy and argmax not in self.stop_ids):
            assert logits is not None, "a stop id chosen before min_tokens needs the logits"
            stops = on_device(sorted(self.stop_ids), torch.long, logits.device)
            logits, greedy = logits.index_fill(-1, stops, -inf), False
        tok = argmax if greedy else self.sampler(logits)
        return None if tok in self.stop_ids else tok

    @property
    def holds_stops(self) -> bool:
        """No stop id may be chosen yet: the answer is short of `min_tokens`."""
        return len(self.out) < self.min_tokens

    def last(self) -> bool:
        """The token chosen now is the answer's last (it reaches max_tokens)."""
        return len(self.out) + 1 >= self.max_tokens

    def emit(self, tok: int) -> bool:
        """Adds a chosen token to the answer and hands it to `on_token`; whether the answer goes on
        (`on_token` did not end it and it is short of max_tokens)."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.out.append(tok)
        return not (self.on_token and self.on_token(tok)) and len(self.out) < self.max_tokens

    def finish(self) -> list[int]:
        """Ends the answer's timing; returns its ids."""
        self.t_end = time.perf_counter()
        return self.out

    @property
    def ttft_s(self) -> float:
        """From t0 to the first token, or to the end of an answer that has none."""
        return (self.t_end if self.t_first is None else self.t_first) - self.t0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first; 0 for an answer of fewer than two."""
        if len(self.out) < 2:
            return 0.0
        return (len(self.out) - 1) / (self.t_end - self.t_first)


def greedy_tokens(logits: torch.Tensor, stops: torch.Tensor, held: torch.Tensor | None) -> torch.Tensor:
    """[B] int64 on the logits' device: each row's greedy token by `Generation.choose`'s rule, the
    argmax, or where `held` [B] bool (the answer `holds_stops`) the argmax over every id but `stops`.
    A batch's tokens are chosen where the logits are, so the next step can read them there."""
    top = logits.argmax(-1)
    if held is None:
        return top
    return torch.where(held, logits.index_fill(-1, stops, -inf).argmax(-1), top)


def decode(step: Step, logits: torch.Tensor, position: int, gen: Generation) -> list[int]:
    """The decode loop of one sequence: feeds each token `gen` chooses, from `position` on, until
    its answer ends; returns the answer's ids. `logits` are the prompt's last."""
    while (tok := gen.next(logits)) is not None:
        logits = step(tok, position)
        position += 1
    return gen.finish()
