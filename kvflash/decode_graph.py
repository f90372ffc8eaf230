"""The decode step as a CUDA graph: one token of one sequence through every layer, replayed.

Eager decode launches a few dozen kernels a layer from Python, and for a small model the GPU waits on
the launches. A graph holds `model.compute` over a PagedKV's decode buffers (`decode_in`, the slot
table padded to the budget, the chunk rotations), so a step is `begin_decode` on the host (residency,
paging, the step's inputs into those buffers), one replay and `end`. Steps that record scoring
queries for a re-selection run eagerly over the same buffers.
"""

from __future__ import annotations

import functools

import torch

from kvflash.models.llama import LlamaForCausalLM
from kvflash.paged_kv import PagedKV


class DecodeGraphs:
    """A sequence's decode step, captured on first use: one graph with turned keys, one without."""

    def __init__(self, model: LlamaForCausalLM, kv: PagedKV):
        assert kv.uses_triton, "decode graphs replay the Triton kernels"
        self.model, self.kv = model, kv
        self._graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        """Steps replayed from a graph (the rest ran eagerly)."""

    @torch.inference_mode()  # as the model's forward: `end` writes summaries into inference tensors
    def __call__(self, token: int, position: int) -> torch.Tensor:
        kv = self.kv
        kv.begin_decode(token, position)
        if kv.graphable:
            graph, logits = self._graphs.get(kv.shifted) or self._capture()
            graph.replay()
            self.replays += 1
        else:
            logits = self._compute()
        kv.end()
        return logits[0]

    def _compute(self) -> torch.Tensor:
        ins = self.kv.decode_in
        return self.model.compute(ins[0:1], ins[1:2], self.kv)

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Captures this step's work. The warm-up on a side stream (as torch's graph docs ask) and the
        replay that follows both write this step's K/V to its slot: the same values twice."""
        side = _warm_up_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._compute()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._compute()
        self._graphs[self.kv.shifted] = graph, logits
        return graph, logits


@functools.cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device: cuBLAS keeps a workspace (32 MiB on the H200) for every stream
    it has run on, so a new stream per capture would hold 32 MiB more each time."""
    return torch.cuda.Stream(device)
