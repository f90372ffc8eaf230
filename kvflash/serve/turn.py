"""One answer over a prepared sequence: prefill the rest of the prompt, generate, and time both."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from math import inf
from typing import TYPE_CHECKING

import torch

from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampler, Sampling
from kvflash.engine.paged_kv import PagedKV

if TYPE_CHECKING:
    from kvflash.serve.prefix_cache import Taken


@dataclass
class TurnStats:
    ttft_s: float = 0.0
    queued_s: float = 0.0
    """Of the TTFT, the wait before the request got a sequence (a server busy with others)."""
    restore_s: float = 0.0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    decode_tok_s: float = 0.0
    source: str = "cold"
    """cold, memory (live in this process), shared (chunks that other live sequences hold), disk, or
    lazy (disk, read on demand)."""
    shared_host_tokens: int = 0
    """Of a shared prefix, the tokens whose chunks only the host tier held (the rest were in the
    pool)."""
    bytes_moved: dict[str, int] = field(default_factory=dict)
    resident_chunks: int = 0
    pinned_chunks: int = 0
    """Chunks the turn's pins keep resident."""
    snapshot_id: str | None = None

    def took(self, taken: Taken) -> None:
        """Where the turn's sequence came from (`PrefixCache.take`): its source, the tokens it
        reused, of a shared prefix those only the host tier held, and a restore's time."""
        self.source, self.restored_tokens = taken.source, taken.restored_tokens
        self.shared_host_tokens, self.restore_s = taken.shared_host_tokens, taken.restore_s

    def to_dict(self) -> dict:
        return asdict(self)


class Generation:
    """One answer, a token at a time: samples each step's logits, ends at a stop id, at max_tokens
    or when `on_token` returns True (a stop string, a client gone), and times it into `stats`. Before
    `min_tokens` tokens no stop id is sampled (a benchmark's answers of a fixed length)."""

    def __init__(
        self,
        max_tokens: int,
        sampler: Sampler,
        stop_ids: frozenset[int],
        stats: TurnStats,
        t0: float,
        on_token: Callable[[int], bool | None] | None = None,
        min_tokens: int = 0,
    ):
        self.max_tokens, self.sampler, self.stop_ids = max_tokens, sampler, stop_ids
        self.stats, self.t0, self.on_token, self.min_tokens = stats, t0, on_token, min_tokens
        self.out: list[int] = []
        self._t_first: float | None = None

    def choose(self, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from logits [V]; a greedy answer takes `argmax` where the caller has it
        (read back for a whole batch at once)."""
        greedy = argmax is not None and self.sampler.greedy
        if len(self.out) < self.min_tokens and not (greedy and argmax not in self.stop_ids):
            stops = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=logits.device)
            logits, greedy = logits.index_fill(-1, stops, -inf), False
        return argmax if greedy else self.sampler(logits)

    def push(self, tok: int) -> int | None:
        """Takes the sampled token: the token to feed next, or None: the answer has ended (a stop id
        is not kept)."""
        if tok in self.stop_ids:
            return None
        if self._t_first is None:
            self._t_first = time.perf_counter()
            self.stats.ttft_s = self._t_first - self.t0
        self.out.append(tok)
        if (self.on_token and self.on_token(tok)) or len(self.out) >= self.max_tokens:
            return None
        return tok

    def finish(self, kv: PagedKV) -> list[int]:
        t_end = time.perf_counter()
        if self._t_first is None:
            self.stats.ttft_s = t_end - self.t0
        self.stats.generated_tokens = len(self.out)
        if len(self.out) > 1:
            self.stats.decode_tok_s = (len(self.out) - 1) / (t_end - self._t_first)
        self.stats.bytes_moved = dict(kv.moved)
        self.stats.resident_chunks = len(kv.resident())
        return self.out


def answer(
    engine: Engine,
    kv: PagedKV,
    rest: list[int],
    max_tokens: int,
    sampling: Sampling,
    stop_ids: frozenset[int],
    stats: TurnStats,
    t0: float,
    on_token: Callable[[int], bool | None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Appends `rest` to kv, then generates up to max_tokens ids (`Generation`). Fills stats'
    prefill, timing and traffic fields; t0 is when the turn began."""
    stats.prefilled_tokens = len(rest)
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        if on_prefill:
            on_prefill(done, len(rest))

    logits = engine.prefill(kv, rest, progress)
    sampler = Sampler(sampling, engine.lm.device)
    gen = Generation(max_tokens, sampler, stop_ids, stats, t0, on_token)
    step, position = engine.decode_step(kv), len(kv.seq)
    while (tok := gen.push(gen.choose(logits))) is not None:
        logits = step(tok, position)
        position += 1
    return gen.finish(kv)
