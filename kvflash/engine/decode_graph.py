"""Decode steps as CUDA graphs: one token of each sequence of a batch through every layer, replayed.

Eager decode launches a few dozen kernels a layer from Python, and for a small model the GPU waits on
the launches. A graph holds `model.compute` over a BatchKV's fixed buffers (the sequences' decode
inputs, slot tables padded to the budget and chunk rotations, stacked), so a step is `begin_decode`
on the host (residency, paging, the step's inputs into those buffers), one replay and `end`. Graphs
belong to a batch shape (size, budget), not to sequences: a new request replays the graphs captured
for earlier ones. A re-selection step replays a graph that also keeps each layer's query, which `end`
scores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflash.engine.batch_kv import BatchKV
from kvflash.models.llama import LlamaForCausalLM


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
    # Other threads keep working while a step is captured (the host tier pins memory ahead, a store
    # reads, a saver waits on copies): only this thread's calls may end the capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        logits = compute()
    return Captured(graph, logits, None if recorded is None else list(recorded))


class BatchGraphs:
    """Batched decode steps, captured on first use per (batch rows, budget, rotated keys, recording
    queries). Each reads the buffers of the one BatchKV the engine keeps for its size and budget; the
    graphs share one memory pool, since only one runs at a time."""

    def __init__(self, model: LlamaForCausalLM):
        self.model = model
        self._graphs: dict[tuple[int, int, bool, bool], Captured] = {}
        self._pool = None
        self.replays = 0
        self.captures = 0

    @torch.inference_mode()  # as the model's forward: `end` writes summaries into inference tensors
    def __call__(
        self, batch: BatchKV, tokens: list[int] | torch.Tensor, positions: list[int]
    ) -> torch.Tensor:
        """One decode step of each of the batch's sequences (Triton kernels, one budget): logits
        [B, V], valid until the next step (the graphs share their memory). Graphs are keyed by the
        batch's rows, pad rows included."""
        batch.begin_decode(tokens, positions)
        assert batch.joint, "a batch graph needs sequences on the Triton kernels with one budget"
        n = len(batch.seqs)
        key = (batch.rows, batch.seqs[0].budget, batch.rotated, batch.recording)
        if key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._graphs[key] = capture(lambda: self._compute(batch), lambda: batch.queries, self._pool)
            self.captures += 1
        run = self._graphs[key]
        run.graph.replay()
        batch.queries = run.queries
        batch.end()
        self.replays += 1
        return run.logits[:n]

    def _compute(self, batch: BatchKV) -> torch.Tensor:
        ids, pos = batch.inputs()
        return self.model.compute(ids, pos, batch, all_logits=True)


@functools.cache
def _warm_up_stream(device: int) -> torch.cuda.Stream:
    """One warm-up stream per device: cuBLAS keeps a workspace for every stream it has run on (PyTorch's
    default size: 32 MiB from compute capability 9 on), so a new stream per capture would hold one
    workspace more each time."""
    return torch.cuda.Stream(device)
