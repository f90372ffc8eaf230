"""Host tier: chunks evicted from the GPU pool, in pinned host memory with the pool's per-chunk layout.

Copies run on a side CUDA stream; the compute stream waits on it (a device-side wait, not a host sync)
only when a page-in was issued or a paged-out slot is about to be rewritten. A step's moves are one
batch each way: one stream switch, and one copy per run of slots adjacent in both tiers.

Pinning host memory is slow, so memory a prefill will need is reserved ahead (`reserve`) and
allocated by a background thread while the GPU computes; a block's pages are touched by torch's
threads and then registered with CUDA (`pinned_empty`), which takes about half the time of
cudaHostAlloc faulting them in one thread (docs/BENCHMARKS.md, Cold prefill). Room that is wanted
later (a server's snapshot staging) waits for a quiet moment (`yield_to`) before it is pinned.

Like the pool's, host slots are counted references, named by chain hash (`ChunkIndex`): a chunk one
sequence paged out is the copy another pages out or reads from disk, and a slot is free once its last
reader has released it. A host copy is written once, when it is taken, and never again.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator

import torch

from kvflash import KVFlashError
from kvflash.engine.chunk_index import ChunkIndex
from kvflash.engine.pool import ChunkPool, chunk_bytes

BLOCK_SLOTS = 64
"""Host memory grows in blocks of this many chunks, so a large budget costs nothing until used."""


QUIET_POLL_S = 0.005
"""How often growth waiting for a quiet moment looks whether room is wanted at once meanwhile."""


class HostTierFull(KVFlashError):
    pass


REGISTER_FLAGS = 3
"""cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every context, and addressable
from the device, which the host tier's in-place scoring reads (`kernels.chunk_lse_in_place`)."""


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor: touched in parallel, then registered with CUDA (unregistered when
    the tensor is collected); cudaHostAlloc's memory where registering fails."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).zero_()
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    if cudart.cudaHostRegister(ptr, t.numel() * t.element_size(), REGISTER_FLAGS) != cudart.cudaError.success:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


def runs(src: list[int], dst: list[int], block: int) -> Iterator[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs of pairs, in src order, whose slots are
    adjacent on both sides and whose src slots stay within one block of `block` slots."""
    pairs = sorted(zip(src, dst, strict=True))
    i = 0
    while i < len(pairs):
        s0, d0 = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n] == (s0 + n, d0 + n) and (s0 + n) // block == s0 // block:
            n += 1
        yield s0, d0, n
        i += n


class HostTier:
    def __init__(self, pool: ChunkPool, budget_bytes: int):
        self.pool = pool
        self.shape = tuple(pool.kv.shape[1:])
        self.dtype = pool.kv.dtype
        self.slot_bytes = chunk_bytes(pool.cfg, pool.chunk_tokens, self.dtype)
        self.max_slots = budget_bytes // self.slot_bytes
        self.cuda = pool.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.kv.device) if self.cuda else None
        self._blocks: list[torch.Tensor | None] = []
        """Allocated blocks in slot order; None while a block is being allocated."""
        self._free: list[int] = []
        self._extra: dict[int, int] = {}
        """Readers beyond the first of each shared slot."""
        self.epoch = 0
        """Changes whenever a slot starts or stops being read by several holders (as
        `ChunkPool.epoch`)."""
        self._index = ChunkIndex()
        """The host copies of sealed chunks of exact KV, by chain hash (under `_grown`: a restore's
        prefetch thread reads into the tier too)."""
        self._pending_in = False
        self._pending_out = False
        self._target = 0
        """Slots `reserve` asked for: the background grower allocates blocks until they exist."""
        self._later = 0
        """Slots `reserve(later=True)` asked for: grown once `_quiet` is set (`yield_to`)."""
        self._quiet: threading.Event | None = None
        self._max_yield_s = 0.0
        self._growing = False
        """The background grower is running (filling a block, or waiting to)."""
        self._filling = 0
        """Blocks the background grower has claimed and is allocating: `alloc_many` waits for them
        rather than allocating its own, but not for a grower waiting for a quiet moment."""
        self._n_slots = 0
        self._grown = threading.Condition()  # a restore's prefetch thread and the grower allocate too

    @property
    def n_used(self) -> int:
        return self._n_slots - len(self._free)

    @property
    def n_allocated(self) -> int:
        """Slots whose memory is allocated: blocks are never given back, so this is the tier's high
        water mark, at most `max_slots`."""
        return self._n_slots

    def _claimed(self) -> int:
        """Under the lock: the slots of the blocks claimed so far, those being allocated included."""
        return len(self._blocks) * BLOCK_SLOTS

    def _claim_block(self) -> int | None:
        """Under the lock: the index of a new block to allocate, or None at the budget."""
        if self._claimed() >= self.max_slots:
            return None
        self._blocks.append(None)
        return len(self._blocks) - 1

    def _fill_block(self, b: int) -> None:
        """Allocates claimed block b (outside the lock) and hands its slots to the free list, behind
        the slots already free."""
        start = b * BLOCK_SLOTS
        n = min(BLOCK_SLOTS, self.max_slots - start)
        shape = (n, *self.shape)
        # An ordinary tensor even when the caller is inside a forward (inference mode): page-outs
        # from outside one (a sequence parked for a new request) write into the block too.
        with torch.inference_mode(False):
            block = pinned_empty(shape, self.dtype) if self.cuda else torch.empty(shape, dtype=self.dtype)
        with self._grown:
            self._blocks[b] = block
            self._n_slots += n
            self._free[:0] = range(start + n - 1, start - 1, -1)
            self._grown.notify_all()

    def yield_to(self, quiet: threading.Event, max_wait_s: float) -> None:
        """Room reserved `later` is pinned once `quiet` is set, waiting up to max_wait_s in all each
        time the tier grows: pinning touches every page on torch's threads and registers them with
        the driver, which a server's requests waiting for their first tokens should not share."""
        self._quiet, self._max_yield_s = quiet, max_wait_s

    def reserve(self, n_slots: int, later: bool = False) -> None:
        """Makes sure host memory for n_slots in all (up to the budget) gets allocated, in the
        background: the first page-outs of a long prefill then find it ready. `later`: room not
        needed before the requests in flight have answered (a snapshot's staging), which waits for
        a quiet moment (`yield_to`); an allocation that finds no free slot meanwhile grows the tier
        itself."""
        n_slots = min(n_slots, self.max_slots)
        with self._grown:
            if later:
                self._later = max(self._later, n_slots)
            else:
                self._target = max(self._target, n_slots)
            if self._growing or self._claimed() >= max(self._target, self._later):
                return
            self._growing = True
        threading.Thread(target=self._grow_ahead, daemon=True, name="kvflash-host-tier").start()

    def _grow_ahead(self) -> None:
        deadline = time.monotonic() + self._max_yield_s
        try:
            while True:
                with self._grown:
                    if self._claimed() >= max(self._target, self._later):
                        return
                    now = self._claimed() < self._target
                if not now:
                    self._wait_quiet(deadline)
                with self._grown:
                    b = None
                    if self._claimed() < max(self._target, self._later):
                        b = self._claim_block()
                    self._filling += b is not None
                if b is None:
                    return
                try:
                    self._fill_block(b)
                finally:
                    with self._grown:
                        self._filling -= 1
                        self._grown.notify_all()
        except Exception:  # out of host memory: alloc grows (and says so) in the caller's thread
            pass
        finally:
            with self._grown:
                self._growing = False
                self._target = self._later = 0
                self._grown.notify_all()

    def _wait_quiet(self, deadline: float) -> None:
        """Until `_quiet` is set, the deadline passes or room is reserved that is wanted now."""
        while self._quiet is not None and not self._quiet.is_set():
            left = deadline - time.monotonic()
            with self._grown:
                if left <= 0 or self._claimed() < self._target:
                    return
            self._quiet.wait(min(left, QUIET_POLL_S))

    def block(self, b: int) -> torch.Tensor:
        """Block b: host slots b * BLOCK_SLOTS on, as one tensor [slots, *chunk shape]."""
        return self._blocks[b]

    def view(self, host_slot: int) -> torch.Tensor:
        return self._blocks[host_slot // BLOCK_SLOTS][host_slot % BLOCK_SLOTS]

    def _run(self, host_slot: int, n: int) -> torch.Tensor:
        """n slots from host_slot on, within one block, as one tensor."""
        i = host_slot % BLOCK_SLOTS
        return self._blocks[host_slot // BLOCK_SLOTS][i : i + n]

    def alloc_many(self, n: int) -> list[int]:
        """n host slots, ascending; a block being allocated ahead is waited for, not allocated twice."""
        out: list[int] = []
        while len(out) < n:
            with self._grown:
                while not self._free and self._filling:
                    self._grown.wait()
                take = min(n - len(out), len(self._free))
                if take:
                    out += self._free[len(self._free) - take :]
                    del self._free[len(self._free) - take :]
                    continue
                b = self._claim_block()
            if b is None:
                self.release_many(out)
                raise HostTierFull(
                    f"the host tier is full ({self.max_slots} chunks); raise --host-bytes "
                    "(EngineConfig.host_bytes) or --pool-tokens"
                )
            self._fill_block(b)
        return sorted(out)

    def alloc(self) -> int:
        return self.alloc_many(1)[0]

    def release(self, host_slot: int) -> None:
        self.release_many([host_slot])

    def release_many(self, host_slots: list[int]) -> None:
        """Drops one reference to each slot; the last reader's release frees it (and its name)."""
        with self._grown:
            for h in host_slots:
                extra = self._extra.pop(h, 0)
                if extra > 1:
                    self._extra[h] = extra - 1
                elif extra:
                    self.epoch += 1
                else:
                    self._index.forget(h)
                    self._free.append(h)

    def publish(self, key: str, host_slot: int) -> None:
        """Names a slot holding the sealed chunk of exact KV whose chain hash is `key`."""
        with self._grown:
            self._index.add(key, host_slot)

    def find(self, key: str) -> int | None:
        with self._grown:
            return self._index.find(key)

    def share(self, key: str) -> int | None:
        """A new reference to the slot named `key`, or None where no slot holds it."""
        with self._grown:
            h = self._index.find(key)
            if h is not None:
                self._add_reader(h)
            return h

    def hold(self, host_slot: int) -> None:
        """One more reader of a slot in use (a staged snapshot reading a sequence's host copy)."""
        with self._grown:
            self._add_reader(host_slot)

    def _add_reader(self, host_slot: int) -> None:
        extra = self._extra.get(host_slot, 0)
        self._extra[host_slot] = extra + 1
        self.epoch += not extra

    def refs(self, host_slot: int) -> int:
        return 1 + self._extra.get(host_slot, 0)

    def page_out(self, gpu_slot: int) -> int:
        """Copies a pool slot into a new host slot (async on CUDA); returns the host slot."""
        return self.page_out_many([gpu_slot])[0]

    def page_out_many(self, gpu_slots: list[int]) -> list[int]:
        """Copies pool slots into new host slots, one copy per adjacent run (async on CUDA); returns
        the host slots, in the order of gpu_slots."""
        if not gpu_slots:
            return []
        hosts = self.alloc_many(len(gpu_slots))
        self._copy_out(hosts, gpu_slots)
        return hosts

    def copy_out(self, gpu_slots: list[int]) -> tuple[list[int], torch.cuda.Event | None]:
        """Copies the first pool slots of gpu_slots that the tier has free host slots for, without
        growing it or waiting for it: a caller that must not stall (a server's scheduler staging a
        snapshot) copies the rest itself. Returns the host slots, in the order of gpu_slots, and on
        CUDA an event recorded after the copies (which run on the side stream, ordered after the
        compute stream's writes): read the host slots from another thread only once it is done."""
        with self._grown:
            take = min(len(gpu_slots), len(self._free))
            hosts = sorted(self._free[len(self._free) - take :])
            del self._free[len(self._free) - take :]
        self._copy_out(hosts, gpu_slots[:take])
        if not (self.cuda and hosts):
            return hosts, None
        done = torch.cuda.Event()
        done.record(self.stream)
        return hosts, done

    def landed(self) -> torch.cuda.Event:
        """An event after every copy queued on the tier's stream so far (page-outs, `copy_out`): a
        host slot another thread reads once it is done holds its bytes (CUDA only)."""
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def _copy_out(self, hosts: list[int], gpu_slots: list[int]) -> None:
        """Pool slots into host slots, one copy per adjacent run (async on the side stream on CUDA);
        the host slots go back to the tier if a copy raises."""
        try:
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream(self.pool.kv.device))
                with torch.cuda.stream(self.stream):
                    for h, g, n in runs(hosts, gpu_slots, BLOCK_SLOTS):
                        self._run(h, n).copy_(self.pool.kv[g : g + n], non_blocking=True)
                self._pending_out = True
            else:
                for h, g, n in runs(hosts, gpu_slots, BLOCK_SLOTS):
                    self._run(h, n).copy_(self.pool.kv[g : g + n])
        except BaseException:
            self.release_many(hosts)
            raise

    def page_in(self, host_slot: int, gpu_slot: int) -> None:
        self.page_in_many([host_slot], [gpu_slot])

    def page_in_many(self, host_slots: list[int], gpu_slots: list[int]) -> None:
        """Copies host slots into pool slots, one copy per adjacent run (async on CUDA)."""
        if not host_slots:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                for h, g, n in runs(host_slots, gpu_slots, BLOCK_SLOTS):
                    self.pool.kv[g : g + n].copy_(self._run(h, n), non_blocking=True)
            self._pending_in = True
        else:
            for h, g, n in runs(host_slots, gpu_slots, BLOCK_SLOTS):
                self.pool.kv[g : g + n].copy_(self._run(h, n))

    def fence(self) -> None:
        """Makes the compute stream wait for issued copies before it reads or rewrites their slots."""
        if self.cuda and (self._pending_in or self._pending_out):
            torch.cuda.current_stream(self.pool.kv.device).wait_stream(self.stream)
        self._pending_in = self._pending_out = False
