"""Decode steps as CUDA graphs: one token of one sequence, or of a batch, through every layer, replayed.

Eager decode launches a few dozen kernels a layer from Python, and for a small model the GPU waits on
the launches. A graph holds `model.compute` over fixed decode buffers (a PagedKV's `decode_in`, its
slot table padded to the budget and its chunk rotations, or a BatchKV's stacks of them), so a step is
`begin_decode` on the host (residency, paging, the step's inputs into those buffers), one replay and
`end`. A re-selection step replays a graph that also keeps each layer's query, which `end` scores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflash.batch_kv import BatchKV
from kvflash.models.llama import LlamaForCausalLM
from kvflash.paged_kv import PagedKV


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    queries: list[torch.Tensor] | None
    """Each layer's query, rewritten by every replay (graphs of re-selection steps)."""


def capture(compute: Callable[[], torch.Tensor], queries: Callable[[], list | None], pool=None) -> Captured:
    """Captures `compute`. The warm-up on a side stream (as torch's graph docs ask) and the replay that
    follows both write this step's K/V to its slot: the same values twice. `queries` gives the list
    the step's attention appends its queries to: emptied of the warm-up's before the capture."""
    side = _warm_up_stream(torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compute()
    torch.cuda.current_stream().wait_stream(side)
    recorded = queries()
    if recorded is not None:
        recorded.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = compute()
    return Captured(graph, logits, None if recorded is None else list(recorded))


class DecodeGraphs:
    """A sequence's decode step, captured on first use per (turned keys, recording queries)."""

    def __init__(self, model: LlamaForCausalLM, kv: PagedKV):
        assert kv.uses_triton, "decode graphs replay the Triton kernels"
        self.model, self.kv = model, kv
        self._graphs: dict[tuple[bool, bool], Captured] = {}
        self.replays = 0
        """Steps replayed from a graph (the rest ran eagerly)."""

    @torch.inference_mode()  # as the model's forward: `end` writes summaries into inference tensors
    def __call__(self, token: int, position: int) -> torch.Tensor:
        kv = self.kv
        kv.begin_decode(token, position)
        if kv.graphable:
            key = (kv.shifted, kv.recording)
            if key not in self._graphs:
                self._graphs[key] = capture(self._compute, lambda: kv.queries)
            run = self._graphs[key]
            run.graph.replay()
            if run.queries is not None:
                kv.queries = list(run.queries)
            self.replays += 1
            logits = run.logits
        else:
            logits = self._compute()
        kv.end()
        return logits[0]

    def _compute(self) -> torch.Tensor:
        ins = self.kv.decode_in
        return self.model.compute(ins[0:1], ins[1:2], self.kv)


class BatchGraphs:
    """Batched decode steps, captured on first use per (batch size, budget, turned keys, recording
    queries). The sequences of a step are staged into the BatchKV of their size and budget, whose
    buffers its graphs read; the graphs share one memory pool, since only one runs at a time."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self._batches: dict[tuple[int, int], BatchKV] = {}
        self._graphs: dict[tuple[int, int, bool, bool], Captured] = {}
        self._pool = None
        self.replays = 0

    @torch.inference_mode()
    def __call__(self, seqs: list[PagedKV], tokens: list[int]) -> torch.Tensor:
        """One decode step of each sequence (Triton kernels, one budget): logits [B, V]."""
        shape = len(seqs), seqs[0].budget
        batch = self._batches.get(shape) or self._batches.setdefault(shape, BatchKV(seqs))
        batch.seqs = seqs
        batch.begin_decode(tokens, [len(kv.seq) for kv in seqs])
        assert batch.joint, "a batch graph needs sequences on the Triton kernels with one budget"
        key = (*shape, batch.turned, batch.recording)
        if key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._graphs[key] = capture(lambda: self._compute(batch), lambda: batch.queries, self._pool)
        run = self._graphs[key]
        run.graph.replay()
        batch.queries = run.queries
        batch.end()
        self.replays += 1
        return run.logits.clone()  # another graph of the pool may reuse this memory

    def _compute(self, batch: BatchKV) -> torch.Tensor:
        ids, pos = batch.inputs()
        return self.model.compute(ids, pos, batch, all_logits=True)


@functools.cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device: cuBLAS keeps a workspace (32 MiB on the H200) for every stream
    it has run on, so a new stream per capture would hold 32 MiB more each time."""
    return torch.cuda.Stream(device)
