"""Several sequences' decode steps as one forward: token i is the next token of sequence i.

The dense layers (projections, MLP, head) run on the whole batch, which reads every weight once for
all of them. On the Triton path attention is one call for the batch too: each layer writes the batch's
new K/V in one launch and attends with one paged-decode call over the sequences' slot tables stacked
(the kernel takes a table per sequence); a sequence's table, valid lengths and key rotations are the
ones its own decode step reads, so batching changes no sequence's residency or attention. Steps where
a sequence records scoring queries (a re-selection), and the reference path, attend per sequence.
"""

from __future__ import annotations

import torch

from kvflash import kernels
from kvflash.paged_kv import PagedKV


class BatchKV:
    """The KVCache of a batched decode step; `begin_decode` replaces `begin`."""

    def __init__(self, seqs: list[PagedKV]):
        self.seqs = seqs
        self.joint = False
        """This step attends with one kernel call for the whole batch."""

    def begin_decode(self, tokens: list[int], positions: list[int]) -> None:
        for kv, tok, pos in zip(self.seqs, tokens, positions, strict=True):
            kv.begin_decode(tok, pos)
        seqs = self.seqs
        self.joint = all(kv.graphable for kv in seqs) and len({kv.budget for kv in seqs}) == 1
        if not self.joint:
            return
        ins = torch.stack([kv.decode_in for kv in seqs])  # [B, DECODE_FIELDS]
        self._slot, self._off, self._n, self._last = (ins[:, i].contiguous() for i in range(2, 6))
        self._table = torch.stack([kv.decode_table() for kv in seqs])
        turned = any(kv.shifted for kv in seqs)
        self._rot = torch.stack([kv.decode_rotation() for kv in seqs]) if turned else None

    def begin(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.begin_decode(input_ids.tolist(), positions.tolist())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.joint:
            outs = [
                kv.attend(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i, kv in enumerate(self.seqs)
            ]
            return torch.cat(outs)
        pool = self.seqs[0].pool.kv
        kernels.write_tokens(pool, layer, self._slot, self._off, k, v)
        return kernels.paged_decode_attention(
            q, pool, layer, self._table, self._n, self._last, q.shape[-1] ** -0.5, self._rot
        )

    def end(self) -> None:
        for kv in self.seqs:
            kv.end()
