"""A decode step whose tokens stay on the device: the next step is prepared and launched with them
there while the host reads them back, so the host's share of a step (residency, the step's inputs,
choosing and handing over tokens) overlaps the device's instead of adding to it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvflash.engine.generate import greedy_tokens
from kvflash.serve.job import Job


class Readback:
    """What every `Ahead` of one scheduler shares: the stop ids on the device, pinned host memory
    for the tokens and the event that says they arrived. A step is read back before the next one is
    launched, so one of each serves every step; they are made once because each torch call of a
    step lets another thread (a store encoding a save) take the interpreter the step waits for."""

    def __init__(self, stops: Iterable[int], device: torch.device):
        self.stops = torch.tensor(sorted(stops), dtype=torch.long, device=device)
        self.cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self.ready = torch.cuda.Event() if self.cuda else None

    def host(self, n: int) -> torch.Tensor:
        """[n] int64 pinned host memory (grown when a step has more rows than any before)."""
        if self._host.numel() < n:
            self._host = torch.empty(max(n, 2 * self._host.numel()), dtype=torch.long, pin_memory=True)
        return self._host[:n]


@dataclass
class Ahead:
    """A launched decode step of `jobs`, every one greedy, whose tokens the host has not read: chosen
    on the device (`greedy_tokens`, the answers' min_tokens rule included) and copied to host memory
    behind the step, without the host waiting for it."""

    jobs: list[Job]
    chosen: torch.Tensor
    """[B] int64 on the device: each job's token."""
    host: torch.Tensor
    """Their copy in host memory, complete once `ready` has passed."""
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, jobs: list[Job], logits: torch.Tensor, rb: Readback) -> Ahead:
        """The tokens of a step whose decode logits [B, V] (valid until the next step) are `logits`;
        the last `Ahead` of `rb` must have been read (`tokens`)."""
        held = [j.gen.holds_stops for j in jobs]
        stops = rb.stops
        mask = torch.tensor(held).to(stops.device, non_blocking=True) if stops.numel() and any(held) else None
        chosen = greedy_tokens(logits, stops, mask)
        if not rb.cuda:
            return cls(jobs, chosen, chosen, None)
        host = rb.host(len(jobs))
        host.copy_(chosen, non_blocking=True)
        rb.ready.record()
        return cls(jobs, chosen, host, rb.ready)

    def tokens(self) -> list[int]:
        """Each job's token, read back (waiting for the step, not for any launched after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def rows(self, jobs: list[Job]) -> torch.Tensor:
        """[len(jobs)] on the device: the tokens of `jobs`, some of this step's in its order."""
        if len(jobs) == len(self.jobs):
            return self.chosen
        row = {id(j): i for i, j in enumerate(self.jobs)}
        index = torch.tensor([row[id(j)] for j in jobs])
        return self.chosen[index.to(self.chosen.device, non_blocking=True)]
