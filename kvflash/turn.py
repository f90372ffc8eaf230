"""One answer over a prepared sequence: prefill the rest of the prompt, generate, and time both."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvflash.engine import Engine
from kvflash.generate import Sampler, Sampling
from kvflash.paged_kv import PagedKV


@dataclass
class TurnStats:
    ttft_s: float = 0.0
    restore_s: float = 0.0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    decode_tok_s: float = 0.0
    source: str = "cold"
    """cold, memory (live in this process), disk, or lazy (disk, read on demand)."""
    bytes_moved: dict[str, int] = field(default_factory=dict)
    resident_chunks: int = 0
    snapshot_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


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
    """Appends `rest` to kv, then generates up to max_tokens ids (a stop id ends and is not kept).
    `on_token` sees each id as it comes and ends the answer by returning True (a stop string, a
    client gone). Fills stats' prefill, timing and traffic fields; t0 is when the turn began."""
    stats.prefilled_tokens = len(rest)
    done = 0

    def progress(n: int) -> None:
        nonlocal done
        done += n
        if on_prefill:
            on_prefill(done, len(rest))

    logits = engine.prefill(kv, rest, progress)
    sampler = Sampler(sampling, engine.lm.device)
    out: list[int] = []
    t_first = None
    for tok in engine.generate(kv, logits, max_tokens, sampler, stop_ids):
        if t_first is None:
            t_first = time.perf_counter()
            stats.ttft_s = t_first - t0
        out.append(tok)
        if on_token and on_token(tok):
            break
    t_end = time.perf_counter()
    if t_first is None:
        stats.ttft_s = t_end - t0
    stats.generated_tokens = len(out)
    if len(out) > 1:
        stats.decode_tok_s = (len(out) - 1) / (t_end - t_first)
    stats.bytes_moved = dict(kv.moved)
    stats.resident_chunks = len(kv.resident())
    return out
