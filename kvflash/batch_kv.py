"""Several sequences' decode steps as one forward: token i is the next token of sequence i.

The dense layers (projections, MLP, head) run on the whole batch, which reads every weight once for
all of them; each sequence then attends over its own chunks through its PagedKV, as in its own
decode step, so batching changes no sequence's residency or attention.
"""

from __future__ import annotations

import torch

from kvflash.paged_kv import PagedKV


class BatchKV:
    """The KVCache of a batched decode step; `begin_decode` replaces `begin`."""

    def __init__(self, seqs: list[PagedKV]):
        self.seqs = seqs

    def begin_decode(self, tokens: list[int], positions: list[int]) -> None:
        for kv, tok, pos in zip(self.seqs, tokens, positions, strict=True):
            kv.begin_decode(tok, pos)

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.begin_decode(input_ids.tolist(), positions.tolist())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = [kv.attend(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i, kv in enumerate(self.seqs)]
        return torch.cat(outs)

    def end(self) -> None:
        for kv in self.seqs:
            kv.end()
