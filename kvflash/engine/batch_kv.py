"""Several sequences' decode steps as one forward: token i is the next token of sequence i.

The dense layers (projections, MLP, head) run on the whole batch, which reads every weight once for
all of them. On the Triton path attention is one call for the batch too: each layer writes the batch's
new K/V in one launch and attends with one paged-decode call over the sequences' slot tables stacked
(the kernel takes a table per sequence); a sequence's table, valid lengths and key rotations are the
ones its own decode step reads, so batching changes no sequence's residency or attention. The step's
inputs go to the device in one copy for the batch, the tables only when one changed. On a re-selection
step the batch keeps each layer's queries and hands each re-selecting sequence its row. The reference
path attends per sequence.
"""

from __future__ import annotations

import torch

from kvflash import kernels
from kvflash.engine.decode_staging import DECODE_FIELDS, Staged
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.sequence import UNKNOWN
from kvflash.engine.to_device import on_device

PAD_FIELDS = (0, 0, None, 0, 1, 1)
"""A pad row's decode inputs: token 0 at position 0, written to the pool's pad slot, which it lists
alone (one valid token)."""


def padded_size(n: int) -> int:
    """The batch size a step of n sequences replays a graph of: 1, 2, 4, 8, then multiples of 8 to 64
    and of 32 beyond, so a server captures a few graphs instead of one per batch size."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 8 if n <= 64 else 32
    return -(-n // step) * step


class BatchKV:
    """The KVCache of a batched decode step; `begin_decode` replaces `begin`. Its buffers keep their
    addresses from step to step while the batch's size and budget do (a CUDA graph reads them). A
    joint step may carry `rows` beyond its sequences: pad rows, whose outputs nobody reads."""

    def __init__(self, seqs: list[PagedKV], rows: int | None = None):
        self.seqs = seqs
        self.rows = rows or len(seqs)
        self.joint = False
        """This step attends with one kernel call for the whole batch."""
        self.rotated = False
        """Some sequence's keys are rotated: the call reads every sequence's rotations."""
        self.recording = False
        """Some sequence records its queries for a re-selection."""
        self.queries: list[torch.Tensor] | None = None
        """Each layer's queries [B, Hq, D] fp32, on joint steps that record."""
        self._ins: Staged | None = None
        self._table: torch.Tensor | None = None
        self._rot: torch.Tensor | None = None
        self._tables_of: list[int] = []
        """The `DecodeStaging.table_write` of each sequence whose table (and rotations) the buffers
        hold."""
        self._host_inputs: tuple[list[int], list[int]] = ([], [])
        self._fed: torch.Tensor | None = None

    def begin_decode(self, tokens: list[int] | torch.Tensor, positions: list[int]) -> None:
        """Starts a step of tokens[i] at positions[i]. Tokens on the device (a tensor [B]: the last
        step's choices, not read back yet) go into the step as they are, so the host prepares it
        while that step still runs; each sequence holds `UNKNOWN` in their place, and names a chunk
        the step completes, once the caller has read them back (`PagedKV.settle`)."""
        seqs = self.seqs  # a decode step on the Triton kernels: a CUDA graph can replay it
        self._fed = tokens if isinstance(tokens, torch.Tensor) else None
        if self._fed is not None:
            tokens = [UNKNOWN] * len(seqs)
        self.joint = (
            all(kv.uses_triton and not kv.scout for kv in seqs) and len({kv.budget for kv in seqs}) == 1
        )
        for kv, tok, pos in zip(seqs, tokens, positions, strict=True):
            kv.begin_decode(tok, pos, send=not self.joint)
        self._host_inputs = tokens, positions
        self.recording = any(kv.recording for kv in seqs)
        self.queries = [] if self.joint and self.recording else None
        if self.joint:
            self._stage()
            if self._fed is not None:  # after the step's fields, in stream order
                self._ins.device[0, : len(seqs)].copy_(self._fed)

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.begin_decode(input_ids.tolist(), positions.tolist())

    def _stage(self) -> None:
        """The sequences' decode inputs into the batch's buffers: fields in one copy, tables stacked."""
        seqs, pads = self.seqs, self.rows - len(self.seqs)
        pool = seqs[0].pool
        if self._ins is None:
            self._ins = Staged((DECODE_FIELDS, self.rows), seqs[0].device)
        pad = tuple(pool.pad_slot if f is None else f for f in PAD_FIELDS)
        staging = [kv.staging for kv in seqs]
        fields = [s.fields for s in staging] + [pad] * pads
        self._ins.send(list(zip(*fields, strict=True)))  # [F, rows]
        self.rotated = any(s.rotated for s in staging)
        writes = [s.table_write for s in staging]
        if writes != self._tables_of:  # most steps list the same chunks as the last
            tables = [s.table for s in staging]
            tables += [torch.full_like(tables[0], pool.pad_slot)] * pads
            self._table = _stack(tables, self._table)
            if self.rotated:
                rots = [s.rotation() for s in staging] + [staging[0].identity_rotation()] * pads
                self._rot = _stack(rots, self._rot)
            self._tables_of = writes

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's token ids and positions [B] on the device."""
        if self.joint:
            return self._ins.device[0], self._ins.device[1]
        dev = self.seqs[0].device
        tokens, positions = self._host_inputs
        ids = self._fed if self._fed is not None else on_device(tokens, torch.long, dev)
        return ids, on_device(positions, torch.long, dev)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.joint:
            outs = [
                kv.attend(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i, kv in enumerate(self.seqs)
            ]
            return torch.cat(outs)
        if self.queries is not None:
            self.queries.append(q.float())
        pool, ins = self.seqs[0].pool.kv, self._ins.device
        kernels.write_tokens(pool, layer, ins[2], ins[3], k, v)
        rot = self._rot if self.rotated else None
        return kernels.paged_decode_attention(
            q, pool, layer, self._table, ins[4], ins[5], q.shape[-1] ** -0.5, rot
        )

    def end(self) -> None:
        for i, kv in enumerate(self.seqs):
            if self.queries is not None and kv.recording:
                kv.record_queries([q[i : i + 1] for q in self.queries])
            kv.end()
        self.seqs = []  # a kept batch holds no finished sequence


def _stack(rows: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """torch.stack, into `out` when it is given (same shape)."""
    return torch.stack(rows) if out is None else torch.stack(rows, out=out)
