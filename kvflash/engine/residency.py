"""Residency policies: which chunks of a sequence are on the GPU for the next step.

`qk` ranks chunks by how well their key summaries match recent queries; `lru` keeps what it has and
drops the least recently used; `sink` keeps the most recent chunks (StreamingLLM); `full` keeps all.
Sinks, the tail window, the chunks a step writes, and pinned chunks are required under every policy.
`Selector` decides when a sequence selects again and with which scores.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.engine.sequence import Chunk, Sequence


def required_chunks(seq: Sequence, cfg: ResidencyConfig, first_touched: int, last_touched: int) -> set[int]:
    sinks = range(min(cfg.sink_chunks, first_touched))
    tail = range(max(0, first_touched - cfg.tail_chunks), first_touched)
    pins = (c.index for c in seq.chunks[:first_touched] if c.pinned)
    return {*sinks, *tail, *pins, *range(first_touched, last_touched + 1)}


def pin_chunks(seq: Sequence, cfg: ResidencyConfig, budget: int, lo: int, hi: int) -> None:
    """Pins the chunks covering token positions [lo, hi), which every selection then holds; refused
    if the floor with them would exceed the budget (`check_pins`)."""
    if not 0 <= lo < hi:
        raise KVFlashError(f"bad pin range [{lo}, {hi})")
    idx = chunks_of([(lo, hi)], cfg.chunk_tokens)
    check_pins(cfg, budget, len({ch.index for ch in seq.chunks if ch.pinned} | idx))
    seq.ensure_chunks(max(idx) * cfg.chunk_tokens + 1)
    for i in idx:
        seq.chunks[i].pinned = True


def chunks_of(ranges: Iterable[tuple[int, int]], chunk_tokens: int) -> set[int]:
    """The indices of the chunks that cover token ranges [lo, hi)."""
    return {i for lo, hi in ranges for i in range(lo // chunk_tokens, (hi - 1) // chunk_tokens + 1)}


def check_pins(cfg: ResidencyConfig, budget: int, n_pinned: int) -> None:
    """KVFlashError if n_pinned chunks would raise the floor (sinks + tail + pins + 2) above a
    sequence's budget: no selection could then hold what a step needs."""
    if cfg.floor_chunks(n_pinned) > budget:
        raise KVFlashError(
            f"pinning {n_pinned} chunks would break the floor: sinks + tail + pins + 2 = "
            f"{cfg.floor_chunks(n_pinned)} > budget {budget} chunks (pin less, or a "
            "larger --pool-tokens)"
        )


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


class Selector:
    """When one sequence selects its resident chunks, and with what: the state a step leaves for the
    next (the scores of the last scoring step, whether it was a scout, tokens since the last due
    selection, pins changed since the last selection)."""

    def __init__(self, cfg: ResidencyConfig, budget: int, step_chunks: int | None = None):
        self.cfg, self.budget = cfg, budget
        self.step_chunks = budget if step_chunks is None else step_chunks
        """The most chunks one step adds to the sequence (its budget where not known): a prefill step
        scores the chunks only where the next step could evict (`records`)."""
        self.scores: torch.Tensor | None = None
        """The last scoring step's scores, applied to the chunks by the next step."""
        self.scouted = False
        """The last step was a scout: its scores are the question's, so the next step may select."""
        self.dirty = True
        """Pins changed since the last selection: the next step must select again."""
        self.since_select = 0
        """Tokens since the last due selection: decode selects again every `tau` of them."""
        self.due = False
        """The selection `want` gave last is a due one (it restarts `since_select` once in place)."""

    def tau(self, seq: Sequence) -> int:
        return max(self.cfg.tau, len(seq) // self.cfg.tau_history_div)

    def roomy(self, seq: Sequence, approximate: bool) -> bool:
        """Every chunk has stayed resident and the budget holds one more: a decode re-selection (and
        the scoring before it) could not change what is resident, so none is due until this ends."""
        return not approximate and len(seq.chunks) < self.budget

    def apply_scores(self, seq: Sequence) -> None:
        if self.scores is not None:
            for ch, s in zip(seq.chunks, self.scores.tolist(), strict=False):
                ch.score = s
            self.scores = None

    def want(
        self, seq: Sequence, first: int, last: int, t: int, scout: bool, approximate: bool
    ) -> set[int] | None:
        """The chunks to hold for a step of t tokens that writes chunks first..last (after applying
        the last scores), or None where the step keeps the last selection: decode inside the
        resident append head, with no selection due, moves nothing."""
        self.apply_scores(seq)
        # A first scout has no scores for the question yet: it runs on the floor alone (sinks, tail,
        # pins, its own chunks), whatever happens to be resident, so that a restored sequence scouts
        # exactly as a cold one does. A later scout selects with the previous one's scores.
        first_scout = scout and not self.scouted
        decode_due = self.since_select >= self.tau(seq) and not self.roomy(seq, approximate)
        # the question's steps after its first scout select whatever their size: a final piece of
        # one token must not keep the first scout's floor
        due = self.due = (t > 1 or scout or self.scouted or decode_due) and not first_scout
        fast = not (due or first_scout or self.dirty)
        if fast and first == last and seq.chunks[first].gpu is not None:
            return None
        if first_scout:
            return required_chunks(seq, self.cfg, first, last)
        # a document's own steps keep what they hold unless a chunk beats it by the margin; the
        # question's steps (scouts, and the step after them) select exactly
        margin = self.cfg.keep_margin if t > 1 and not (scout or self.scouted) else 0.0
        return select_resident(seq, self.cfg, self.budget, first, last, due, margin)

    def selected(self) -> None:
        """The selection `want` gave is in place (its chunks paged in): pins are current, and after
        a due one the next falls due `tau` tokens on. A selection that could not be put in place
        leaves both as they were, so the next step selects again."""
        self.dirty = False
        if self.due:
            self.since_select = 0

    def records(self, seq: Sequence, t: int, scout: bool, approximate: bool) -> bool:
        """A step of t tokens records its queries to score the chunks: under `qk`, scouts, prefill
        steps after which the next step could hold more chunks than the budget, and the decode step
        before a re-selection falls due. Scores serve only selections that evict, and each scoring
        step's scores replace the last ones, so a prefill step whose next step cannot evict would
        score for nothing (the first step that could is preceded by one that scored: a step adds
        at most `step_chunks`)."""
        due_next = self.since_select + t >= self.tau(seq) and not self.roomy(seq, approximate)
        next_may_evict = approximate or len(seq.chunks) + self.step_chunks > self.budget
        return self.cfg.policy == "qk" and (scout or (t > 1 and next_may_evict) or due_next)

    def ended(self, t: int, scout: bool, scores: torch.Tensor | None) -> None:
        """A step of t tokens ended, with the scores it computed (None: it scored nothing)."""
        self.scouted = scout
        if scores is not None:
            self.scores = scores
        if not scout:
            self.since_select += t

    def reset(self) -> None:
        """The sequence dropped tokens (`PagedKV.truncate`): its next step selects afresh."""
        self.scores, self.scouted, self.dirty, self.since_select = None, False, True, 0
