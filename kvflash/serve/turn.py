"""One answer over a prepared sequence: prefill the rest of the prompt, generate, and time both."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, decode
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
    """Bytes of chunk KV this turn moved, by tier (a restore's reads included)."""
    evicted_chunks: int = 0
    """Chunks this turn evicted from the pool."""
    resident_chunks: int = 0
    pinned_chunks: int = 0
    """Chunks the turn's pins keep resident."""
    snapshot_id: str | None = None
    arrival_time: float = field(default_factory=time.time)
    """When the request reached the engine (its prompt tokenised), in seconds of the epoch."""
    finished_time: float = 0.0
    """When its answer ended, likewise: what a client on the same machine can set beside its own
    clock, and the span of a server's turn over many requests (as vLLM's request metrics)."""
    _moved_before: dict[str, int] = field(default_factory=dict, repr=False)
    """A continued live sequence's traffic before this turn (`took`), which is not this turn's."""
    _evicted_before: int = field(default=0, repr=False)

    def took(self, taken: Taken) -> None:
        """Where the turn's sequence came from (`PrefixCache.take`): its source, the tokens it
        reused, of a shared prefix those only the host tier held, and a restore's time."""
        self.source, self.restored_tokens = taken.source, taken.restored_tokens
        self.shared_host_tokens, self.restore_s = taken.shared_host_tokens, taken.restore_s
        if taken.source == "memory":  # a live sequence goes on: earlier turns' traffic is theirs
            self._moved_before, self._evicted_before = dict(taken.kv.moved), taken.kv.pager.evicted

    def answered(self, gen: Generation, kv: PagedKV) -> None:
        """The finished answer's count and timing (`Generation`), and the traffic and residency of
        its sequence."""
        self.ttft_s, self.decode_tok_s, self.generated_tokens = gen.ttft_s, gen.decode_tok_s, len(gen.out)
        self.finished_time = time.time()
        self.bytes_moved = {tier: n - self._moved_before.get(tier, 0) for tier, n in kv.moved.items()}
        self.evicted_chunks = kv.pager.evicted - self._evicted_before
        self.resident_chunks = len(kv.resident())

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


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
    """Appends `rest` to kv, then generates up to max_tokens ids (`Generation`, `decode`). Fills
    stats' prefill, timing and traffic fields; t0 is when the turn began."""
    stats.prefilled_tokens = len(rest)
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        if on_prefill:
            on_prefill(done, len(rest))

    logits = engine.prefill(kv, rest, progress)
    gen = Generation(max_tokens, Sampler(sampling, engine.lm.device), stop_ids, on_token, t0=t0)
    out = decode(engine.decode_step(kv), logits, len(kv.seq), gen)
    stats.answered(gen, kv)
    return out
