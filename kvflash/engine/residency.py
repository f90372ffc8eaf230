"""Residency policies: which chunks of a sequence are on the GPU for the next step.

`qk` ranks chunks by how well their key summaries match recent queries; `lru` keeps what it has and
drops the least recently used; `sink` keeps the most recent chunks (StreamingLLM); `full` keeps all.
Sinks, the tail window, the chunks a step writes, and pinned chunks are required under every policy.
"""

from __future__ import annotations

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.engine.sequence import Chunk, Sequence


def required_chunks(seq: Sequence, cfg: ResidencyConfig, first_touched: int, last_touched: int) -> set[int]:
    sinks = range(min(cfg.sink_chunks, first_touched))
    tail = range(max(0, first_touched - cfg.tail_chunks), first_touched)
    pins = (c.index for c in seq.chunks[:first_touched] if c.pinned)
    return {*sinks, *tail, *pins, *range(first_touched, last_touched + 1)}


def select_resident(
    seq: Sequence,
    cfg: ResidencyConfig,
    budget: int,
    first_touched: int,
    last_touched: int,
    reselect: bool,
    keep_margin: float = 0.0,
) -> set[int]:
    """The chunk indices to hold for a step that writes chunks first_touched..last_touched.

    Without `reselect` only chunks already resident are candidates, so nothing is paged in. Under
    `qk`, `keep_margin` m is hysteresis: a resident chunk ranks as if its score were (1 + m) times
    what it is, so a chunk comes in only by beating the weakest resident one by more than that
    factor. Scores are fresh every step, so the staleness is bounded by the margin alone: no chunk
    whose score beats a kept one's by more than the factor is ever left out.
    """
    n_needed = last_touched + 1
    if cfg.policy == "full":
        if n_needed > budget:
            raise KVFlashError(
                f"context of {n_needed * cfg.chunk_tokens} tokens needs {n_needed} chunks but the pool "
                f"budget is {budget} chunks; use policy qk, lru or sink, or a larger pool"
            )
        return set(range(n_needed))
    required = required_chunks(seq, cfg, first_touched, last_touched)
    if len(required) > budget:
        raise KVFlashError(
            f"a step needs {len(required)} resident chunks (sinks, tail, pins and the chunks it writes) "
            f"but the budget is {budget} chunks"
        )
    room = budget - len(required)
    candidates = [
        c
        for c in seq.chunks[:first_touched]
        if c.index not in required and c.sealed and (c.gpu is not None or (reselect and cfg.policy != "lru"))
    ]
    if cfg.policy == "qk":
        keep = 1.0 + keep_margin

        def rank(c: Chunk) -> tuple[float, int]:
            return (c.score * keep if c.gpu is not None and c.score > 0 else c.score), c.index

        candidates.sort(key=rank, reverse=True)
    elif cfg.policy == "lru":
        candidates.sort(key=lambda c: (c.last_use, c.index), reverse=True)
    else:  # sink: the most recent window
        candidates.sort(key=lambda c: c.index, reverse=True)
    return required | {c.index for c in candidates[:room]}
