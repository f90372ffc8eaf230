"""A sequence's decode-step inputs on the device, at fixed addresses, for the Triton kernels.

A decode step (one token) reads its write slot and offset, slot table, valid lengths and key
rotations from device buffers that keep their addresses and width (the budget) from step to step:
an eager step and the CUDA graph replaying it launch the same kernels on the same data, and a batch
(`BatchKV`) stacks its sequences' buffers into its own. The table and rotations change only when a
selection lists other chunks; each such write is numbered (`table_write`), so a batch re-copies them
only when a number changed. The step's scalar inputs reach the device in one asynchronous copy.
"""

from __future__ import annotations

import itertools
import threading

import torch

from kvflash import kernels

DECODE_FIELDS = 6
"""`DecodeStaging.inputs`: token id, position, write slot, write offset, chunks listed, valid in the last."""

_table_writes = itertools.count()
"""Numbers every write of any sequence's slot table: a batch that holds copies of its sequences'
tables re-copies them only when one of these numbers changed."""


ROW_ALIGN = 4
"""int32s a `Staged` row is padded to: 16 bytes, so every row starts 16-byte aligned."""


class Staged:
    """A small int32 device buffer written from pinned host memory in one asynchronous copy: a decode
    step's inputs reach the device without the host waiting on it. Each row along the last dimension
    starts on a 16-byte boundary whatever its length: Triton compiles a kernel once per alignment of
    its pointer arguments, so a batch's fields at offsets that moved with the batch size made a mixed
    step of, say, 19 decode rows compile a variant no warm-up had met, in the middle of serving."""

    def __init__(self, shape: tuple[int, ...], device: torch.device):
        cuda = device.type == "cuda"
        *lead, n = shape
        padded = (*lead, -(-n // ROW_ALIGN) * ROW_ALIGN)
        self._device = torch.zeros(padded, dtype=torch.int32, device=device)
        self._host = torch.zeros(padded, dtype=torch.int32, pin_memory=cuda)
        self.device = self._device[..., :n]
        """The buffer, `shape`: a view whose rows start 16-byte aligned."""
        self._values = self._host.numpy()[..., :n]
        self._sent = torch.cuda.Event() if cuda else None

    def send(self, values) -> None:
        """values: anything numpy assigns to the buffer's shape (a [B, F] buffer takes B rows)."""
        if self._sent is not None and not self._sent.query():  # asking does not let go of the GIL
            self._sent.synchronize()  # the previous copy has read the host buffer
        self._values[:] = values
        self._device.copy_(self._host, non_blocking=True)
        if self._sent is not None:
            self._sent.record()


class DecodeStaging:
    """The device buffers every decode step of one sequence reads; written by its selections (`list`)
    and steps (`stage`), never reallocated."""

    def __init__(self, budget: int, head_dim: int, device: torch.device):
        self.table = torch.zeros(budget, dtype=torch.int32, device=device)
        """The listed slots in logical order, the first `inputs[4]` of them valid."""
        self.table_rot = torch.zeros(budget, 2, head_dim // 2, device=device)
        """Each listed chunk's key rotation (`CachePositions.listed`), read when `rotated`."""
        self._staged = Staged((DECODE_FIELDS,), device)
        self.inputs = self._staged.device
        """[DECODE_FIELDS] int32 on the device: this step's fields."""
        self.write = self.inputs[2:3], self.inputs[3:4]
        """The slot and offset a decode step writes, as views of `inputs`."""
        self.fields: tuple[int, ...] = ()
        """This decode step's `inputs`, on the host (a batch sends several together)."""
        self.rotated = False
        """The listed chunks' keys are rotated (cache positions with chunks evicted between them)."""
        self.table_write = next(_table_writes)
        """The number of the last write of `table` (and of `table_rot`)."""
        self._identity: torch.Tensor | None = None

    def list(self, slots: torch.Tensor, rot: torch.Tensor | None) -> None:
        """A selection's listed slots [n] int32 and their rotations [n, 2, D/2] (None: none rotated)
        into the table, as a new numbered write."""
        n = slots.numel()
        self.table[:n].copy_(slots)
        self.rotated = rot is not None
        if self.rotated:
            self.table_rot[:n].copy_(rot)
        self.table_write = next(_table_writes)

    def stage(self, token: int, position: int, slot: int, offset: int, listed: int, send: bool) -> None:
        """A decode step's inputs: the token at `position`, written at `offset` of `slot`, over the
        `listed` chunks of the table, the last (the append head, holding this token) valid up to it.
        Sent to `inputs` in one copy if `send`; else a batch sends `fields` with its others'."""
        self.fields = (token, position, slot, offset, listed, offset + 1)
        if send:
            self._staged.send(self.fields)

    def rotation(self) -> torch.Tensor:
        """[budget, 2, D/2]: each listed chunk's key rotation this decode step, the identity (cos 1,
        sin 0) when no key is rotated, so that a batch mixing both can run as one kernel call."""
        return self.table_rot if self.rotated else self.identity_rotation()

    def identity_rotation(self) -> torch.Tensor:
        """[budget, 2, D/2] of cos 1, sin 0: rotates no key."""
        if self._identity is None:
            self._identity = torch.zeros_like(self.table_rot)
            self._identity[:, 0] = 1.0
        return self._identity

    def attend(self, q: torch.Tensor, kv_pool: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        """This sequence's decode attention alone (a batch attends for all of its sequences at once)."""
        ins, rot = self.inputs, self.table_rot[None] if self.rotated else None
        return kernels.paged_decode_attention(
            q, kv_pool, layer, self.table[None], ins[4:5], ins[5:6], scale, rot
        )


class StagingCache:
    """The decode buffers of freed sequences, for the next sequences of the same budget. New
    buffers pin host memory (`cudaHostAlloc`) and allocate device tables, milliseconds of the
    scheduler's thread per admitted request; a reused one costs nothing. At most `keep` wait here."""

    def __init__(self, head_dim: int, device: torch.device, keep: int = 256):
        self.head_dim, self.device, self.keep = head_dim, device, keep
        self._free: dict[int, list[DecodeStaging]] = {}
        self._lock = threading.Lock()  # sequences are made and freed on several threads

    def take(self, budget: int) -> DecodeStaging:
        """Buffers for a sequence of `budget` chunks: a freed sequence's, renumbered (a batch that
        copied its table copies the new owner's), or new ones."""
        with self._lock:
            free = self._free.get(budget)
            staging = free.pop() if free else None
        if staging is None:
            return DecodeStaging(budget, self.head_dim, self.device)
        staging.rotated, staging.fields = False, ()
        staging.table_write = next(_table_writes)
        return staging

    def give(self, staging: DecodeStaging) -> None:
        """Buffers of a freed sequence, which reads them no more."""
        with self._lock:
            if sum(map(len, self._free.values())) < self.keep:
                self._free.setdefault(staging.table.numel(), []).append(staging)
