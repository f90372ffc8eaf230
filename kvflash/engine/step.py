"""One forward over several sequences: the decode tokens of running ones and prefill pieces of others.

The dense layers (projections, MLP, head) run once over every row of the step, so each weight is read
once for all of them and one set of launches serves every sequence; attention runs per part: the
decode rows as one batched call (BatchKV), the prefill pieces as one batched call too where the
Triton kernels run (`PieceBatch`), else each over its own sequence (PagedKV). This is
chunked prefill mixed with decode, as vLLM and SGLang schedule it: a long prompt goes in pieces that
ride along with the others' decode tokens, and many short prompts (the next turns of conversations
whose KV is live) prefill in one forward instead of one each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflash import kernels
from kvflash.engine.batch_kv import BatchKV
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.to_device import on_device


@dataclass
class Piece:
    """Prompt ids a step appends to one sequence, from position `start`."""

    kv: PagedKV
    ids: list[int]
    start: int
    final: bool
    """The prompt's last piece: the logits after its last id choose the first answer token."""


class Prefill:
    """A prompt's prefill, a piece at a time: `next` plans a piece, the caller runs it (alone or in a
    mixed step) and reports it with `ran`, and only then may the next be planned (its size and
    residency follow what the sequence holds after the last)."""

    def __init__(
        self,
        plan: Callable[[PagedKV, int], int],
        scout: Callable[[Piece], None],
        kv: PagedKV,
        ids: list[int],
        on_progress: Callable[[int], None] | None = None,
    ):
        assert ids, "a prefill needs at least one token"
        self._plan, self._scout, self.kv, self.ids, self.on_progress = plan, scout, kv, ids, on_progress
        self.done = 0

    def next(self, limit: int | None = None) -> Piece:
        """The next piece: up to the chunk boundary the engine plans (`Engine.step_chunks`), and at
        most `limit` tokens (at least one) where given. Under `qk`, the last piece of a prompt longer
        than the budget is first run as scouts, whose queries (the question's) select the chunks the
        last piece attends to."""
        kv, remaining = self.kv, len(self.ids) - self.done
        pos, c = len(kv.seq), kv.cfg.chunk_tokens
        boundary = (pos // c + self._plan(kv, remaining)) * c
        n = min(remaining, boundary - pos, remaining if limit is None else max(1, limit))
        piece = Piece(kv, self.ids[self.done : self.done + n], pos, self.done + n == len(self.ids))
        if piece.final and kv.cfg.policy == "qk" and -(-(pos + n) // c) > kv.budget:
            self._scout(piece)  # the context, this piece's tokens included, exceeds the budget
        return piece

    def ran(self, piece: Piece) -> None:
        self.done += len(piece.ids)
        if self.on_progress:
            self.on_progress(len(piece.ids))


@dataclass
class PieceBatch:
    """A mixed step's prefill pieces attending in one launch a layer: their K/V written by one call,
    their queries attended by one (`kernels.prefill_attention_batched`), each over its own
    listing. Launches are paid per call, and a step of many short pieces (the next turns of many
    conversations) otherwise makes three a piece a layer, which the host cannot issue as fast as
    the GPU runs them. Built once a step, from the pieces' plans."""

    pieces: list[Piece]
    write_slot: torch.Tensor
    write_offset: torch.Tensor
    table: torch.Tensor
    """[P, 5] int32: each piece's first row (among the pieces'), rows, first position, first
    listed slot and slots listed."""
    slots: torch.Tensor
    order: torch.Tensor
    max_t: int
    scoring: list[tuple[PagedKV, int, int]]
    """The pieces whose step scores the chunks, with their rows: only they keep queries."""

    @classmethod
    def of(cls, pieces: list[Piece]) -> PieceBatch | None:
        """The batch of `pieces`, begun; None unless there are two or more and each may join."""
        if len(pieces) < 2 or not all(p.kv.joins_batched_prefill for p in pieces):
            return None
        plans = [p.kv.plan for p in pieces]
        rows, listed = [0], [0]
        for plan in plans:
            rows.append(rows[-1] + len(plan.ids))
            listed.append(listed[-1] + plan.listing.n)
        table = [[rows[i], len(pl.ids), pl.start, listed[i], pl.listing.n] for i, pl in enumerate(plans)]
        scoring = [
            (p.kv, rows[i], rows[i + 1])
            for i, p in enumerate(pieces)
            if p.kv.plan.queries is not None and p.kv.plan.n_cand
        ]
        dev = pieces[0].kv.device
        return cls(
            pieces,
            torch.cat([pl.write_slot for pl in plans]),
            torch.cat([pl.write_offset for pl in plans]),
            on_device(table, torch.int32, dev),
            torch.cat([pl.listing.slots for pl in plans]),
            torch.cat([pl.listing.order for pl in plans]),
            max(len(pl.ids) for pl in plans),
            scoring,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pieces[0].kv.pool.kv
        kernels.write_tokens(pool, layer, self.write_slot, self.write_offset, k, v)
        if self.scoring:  # their queries in fp32 in one conversion (each keeps a view of its rows)
            rows = q.float()
            for kv, lo, hi in self.scoring:
                kv.keep_queries(rows[lo:hi])
        scale = q.shape[-1] ** -0.5
        return kernels.prefill_attention_batched(
            q, pool, layer, self.table, self.slots, self.order, self.max_t, scale
        )


class MixedKV:
    """The KVCache of a mixed step: rows 0..B-1 are the decode tokens of `batch`'s sequences, then
    each piece's ids in order."""

    def __init__(self, batch: BatchKV | None, pieces: list[Piece]):
        self.batch, self.pieces = batch, pieces
        self._parts: list[tuple[BatchKV | PagedKV | PieceBatch, int, int]] = []

    def begin(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Starts every part's step; returns the step's ids and positions [T] and the rows whose
        logits are wanted [B + P] (each decode row, each piece's last), all on the device."""
        dev = self.pieces[0].kv.pool.kv.device
        ids, pos, rows, lo = [], [], [], 0
        if self.batch is not None:
            self.batch.begin_decode(tokens, [len(kv.seq) for kv in self.batch.seqs])
            lo = len(tokens)
            self._parts.append((self.batch, 0, lo))
            rows.extend(range(lo))
        first = lo
        for p in self.pieces:
            p.kv.begin_ids(p.ids, p.start)
            ids += p.ids
            pos += range(p.start, p.start + len(p.ids))
            self._parts.append((p.kv, lo, lo + len(p.ids)))
            lo += len(p.ids)
            rows.append(lo - 1)
        if (together := PieceBatch.of(self.pieces)) is not None:
            self._parts[len(self._parts) - len(self.pieces) :] = [(together, first, lo)]
        host = on_device([ids, pos], torch.long, dev)
        rows_d = on_device(rows, torch.long, dev)
        if self.batch is None:
            return host[0], host[1], rows_d
        b_ids, b_pos = self.batch.inputs()
        return torch.cat([b_ids.long(), host[0]]), torch.cat([b_pos.long(), host[1]]), rows_d

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.attend(layer, q[lo:hi], k[lo:hi], v[lo:hi]) for part, lo, hi in self._parts])

    def end(self) -> None:
        if self.batch is not None:
            self.batch.end()
        for p in self.pieces:
            p.kv.end()
