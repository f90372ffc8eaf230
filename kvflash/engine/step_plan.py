"""What one step of one sequence reads: the chunks it attends over and where its tokens go.

`PagedKV.begin` builds a `StepPlan` once per step, `attend` reads it in every layer and `end` clears
it, so nothing of a step outlives it but its `Listing`, which a later step that selects nothing
reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Listing:
    """The resident chunks a selection lists for attention, in logical order. It changes only when
    residency does: a decode step inside the resident append head attends over the last one."""

    slots: torch.Tensor
    """[n] int32: the listed chunks' pool slots."""
    order: torch.Tensor
    """[n] int32: their chunk indices, ascending."""
    rot: torch.Tensor | None
    """[n, 2, D/2]: each chunk's key rotation to its cache position (`CachePositions.listed`), or
    None when no listed chunk has evicted chunks between it and the step's queries."""
    key_pos: torch.Tensor | None
    """[n * C]: the listed keys' positions, for the reference path's causal mask (None on Triton)."""
    n: int
    """Chunks listed."""


@dataclass(slots=True)
class StepPlan:
    """One step's fields, set by `PagedKV.begin` and read by `attend` and `end`."""

    ids: list[int]
    """The step's token ids, appended to the sequence at `end` (unless a scout)."""
    start: int
    """The step's first position."""
    scout: bool
    """The step computes scores only: it neither advances the sequence nor seals chunks."""
    listing: Listing
    write_slot: torch.Tensor
    write_offset: torch.Tensor
    """[T] int32: the slot and offset each token's K/V is written to (views of the decode inputs
    on a Triton decode step)."""
    mask: torch.Tensor | None
    """[T, n * C]: which listed keys each query sees (reference path only)."""
    n_cand: int
    """Candidates: the chunks before the step's first, which `end` scores."""
    cand_rot: torch.Tensor | None
    """[n_cand, 2, D/2]: where each candidate is scored from (`CachePositions.candidates`)."""
    exact: bool
    """The queries are scored from exact keys (scouts, decode re-selection), not from the summaries."""
    queries: list[torch.Tensor] | None
    """Each layer's scoring queries, on steps that score the chunks at `end`; a batch that attended
    for the sequence hands in its rows instead (`PagedKV.record_queries`)."""

    @property
    def end(self) -> int:
        """One past the step's last position."""
        return self.start + len(self.ids)
