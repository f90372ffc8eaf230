"""A decode step whose tokens stay on the device: the next step is prepared and launched with them
there while the host reads them back, so the host's share of a step (residency, the step's inputs,
choosing and handing over tokens) overlaps the device's instead of adding to it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflash.engine.generate import greedy_tokens
from kvflash.serve.job import Job


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
    def launch(cls, jobs: list[Job], logits: torch.Tensor, stops: torch.Tensor) -> Ahead:
        """The tokens of a step whose decode logits [B, V] (valid until the next step) are `logits`."""
        held = [j.gen.holds_stops for j in jobs]
        dev = logits.device
        mask = torch.tensor(held).to(dev, non_blocking=True) if stops.numel() and any(held) else None
        chosen = greedy_tokens(logits, stops, mask)
        if dev.type != "cuda":
            return cls(jobs, chosen, chosen, None)
        host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
        host.copy_(chosen, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(jobs, chosen, host, ready)

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
