"""Host values (slot lists, token ids, positions) to the device without waiting for it.

`torch.tensor(values, device=cuda)` copies with `non_blocking=False`, which ends in a
cudaStreamSynchronize: the host waits for every kernel launched before it. A step's bookkeeping
(the slots a sealed chunk's summaries are read from, a selection's listing, a piece's write slots)
then waits for the step launched before it, and the host's share of a step no longer overlaps the
device's. The same copy from a fresh pageable tensor with `non_blocking=True` is staged by the
driver before the call returns (the source may go at once) and runs in stream order, as a kernel
would, with no wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def on_device(
    values: Sequence[int] | Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`values` as a tensor of `dtype` on `device`, copied in stream order, not waited for."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
