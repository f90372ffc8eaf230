"""Each Triton kernel against its torch twin; the twins against plain SDPA.

The kernels run in two places: on CPU through the Triton interpreter at small sizes (`test_interp_*`),
and on CUDA at real sizes (`test_gpu_*`, `-m gpu`). The interpreter must be switched on before any
kernel is defined, and other test files share this process, so on a machine without CUDA the normal
run starts this file again in a subprocess with TRITON_INTERPRET=1 (`test_kernels_under_interpreter`)
and the `interp` cases run only there. Every input position no query may see is NaN, and every tensor
a kernel wrapper allocates starts as NaN, so a kernel that reads a stale byte or leaves an output
unwritten fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import random
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from kvflash import kernels

ref = kernels.reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()

interp = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter subprocess")


def on_gpu(fn):
    """Real-size cases: `-m gpu`, on a CUDA device with triton."""
    needs = pytest.mark.skipif(not (CUDA and HAVE_TRITON), reason="needs CUDA and triton")
    return pytest.mark.gpu(needs(fn))


TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def triton_impl(module: str):
    return importlib.import_module(f"kvflash.kernels.{module}")


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.is_floating_point() else -(2**30))


@contextlib.contextmanager
def poisoned_outputs():
    """Every tensor allocated inside the block starts as NaN (ints: a huge negative)."""
    empty, empty_like = torch.empty, torch.empty_like
    with (
        mock.patch.object(torch, "empty", lambda *a, **k: _poison(empty(*a, **k))),
        mock.patch.object(torch, "empty_like", lambda *a, **k: _poison(empty_like(*a, **k))),
    ):
        yield


def nan_pool(n_slots: int, layers: int, h_kv: int, c: int, d: int, dtype: torch.dtype, device: str):
    return torch.full((n_slots, layers, 2, h_kv, c, d), float("nan"), dtype=dtype, device=device)


def close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == want.dtype and out.shape == want.shape
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


# -- paged decode ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decode:
    batch: int
    h_kv: int
    group: int
    d: int
    c: int
    max_n: int
    dtype: torch.dtype
    splits: int | None = None
    seed: int = 0


def decode_inputs(case: Decode, device: str):
    """Disjoint shuffled slots per sequence, 1..max_n of them; the table is padded with garbage."""
    g = torch.Generator().manual_seed(case.seed)
    layers, layer = 2, 1
    n = torch.randint(1, case.max_n + 1, (case.batch,), generator=g)
    n[0] = case.max_n
    last_valid = torch.randint(1, case.c + 1, (case.batch,), generator=g)
    pool_slots = int(n.sum()) + 3
    perm = torch.randperm(pool_slots, generator=g)
    table = torch.full((case.batch, case.max_n), pool_slots + 1000, dtype=torch.int32)
    pool = nan_pool(pool_slots, layers, case.h_kv, case.c, case.d, case.dtype, "cpu")
    used = 0
    for b in range(case.batch):
        nb = int(n[b])
        table[b, :nb] = perm[used : used + nb]
        used += nb
        slots = table[b, :nb].long()
        pool[slots[:-1], layer] = torch.randn(nb - 1, 2, case.h_kv, case.c, case.d, generator=g).to(
            case.dtype
        )
        lv = int(last_valid[b])
        pool[slots[-1], layer, :, :, :lv] = torch.randn(2, case.h_kv, lv, case.d, generator=g).to(case.dtype)
    q = torch.randn(case.batch, case.h_kv * case.group, case.d, generator=g).to(case.dtype)
    args = (q, pool, layer, table, n.int(), last_valid.int(), case.d**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def random_rot(lead: tuple[int, ...], d: int, seed: int, device: str) -> torch.Tensor:
    """Per-chunk RoPE rotations [*lead, 2, D/2] (cos, sin) for random shifts of up to 5,000 positions."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.randint(0, 5000, lead, generator=g).float()
    ang = shift[..., None] * 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    return torch.stack([ang.cos(), ang.sin()], -2).to(device)


def check_decode(case: Decode, device: str, fused: bool = True, shifted: bool = False) -> None:
    args = decode_inputs(case, device)
    rot = random_rot((case.batch, case.max_n), case.d, case.seed, device) if shifted else None
    with poisoned_outputs():
        out = triton_impl("triton_decode").paged_decode_attention(
            *args, n_splits=case.splits, fused=fused, rot=rot
        )
    close(out, ref.paged_decode_attention(*args, rot=rot), case.dtype)


INTERP_DECODE = [
    Decode(1, 1, 1, 64, 16, 1, torch.float32),
    Decode(2, 2, 3, 64, 16, 5, torch.float32, splits=3),
    Decode(3, 1, 4, 128, 64, 3, torch.bfloat16),
    Decode(2, 1, 8, 64, 64, 4, torch.float16, splits=1),
    Decode(2, 3, 3, 64, 16, 9, torch.bfloat16, seed=1),
    Decode(1, 2, 4, 128, 16, 7, torch.float32, splits=2, seed=2),
    Decode(3, 1, 1, 128, 64, 2, torch.float16, seed=3),
    Decode(2, 1, 3, 64, 64, 6, torch.bfloat16, splits=4, seed=4),
]
GPU_DECODE = [
    Decode(8, 8, 4, 128, 64, 300, torch.bfloat16),
    Decode(5, 3, 3, 64, 64, 1025, torch.bfloat16, seed=1),
    Decode(33, 8, 4, 128, 64, 17, torch.float16, seed=2),
    Decode(3, 2, 8, 128, 16, 501, torch.float32, seed=3),
    Decode(2, 4, 1, 64, 64, 2048, torch.bfloat16, seed=4),
]


@interp
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("case", INTERP_DECODE, ids=str)
def test_interp_decode(case: Decode, fused: bool) -> None:
    check_decode(case, "cpu", fused)


@interp
@pytest.mark.parametrize("case", INTERP_DECODE[1::2], ids=str)
def test_interp_decode_shifted(case: Decode) -> None:
    check_decode(case, "cpu", fused=False, shifted=True)


@interp
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_interp_decode_splits(splits: int, fused: bool) -> None:
    """One split writes the output itself; five splits over three 128-token blocks leave two empty.
    Both merges take two splits a step here, so five take three steps, the last one partial."""
    case = Decode(2, 2, 3, 64, 16, 24, torch.float32, splits=splits, seed=5)
    td = triton_impl("triton_decode")
    with mock.patch.object(td, "MERGE_ELEMS", 2 * 4 * 64), mock.patch.object(td, "COMBINE_ROWS", 2):
        check_decode(case, "cpu", fused)


@interp
def test_interp_decode_fused_twice() -> None:
    """Two fused calls of other shapes in a row. The interpreter runs programs one after another, so
    a wrong choice of merging program can still leave the right output; counting merges catches it:
    exactly one per (sequence, kv-head), and the counters back at zero for the next call."""
    td = triton_impl("triton_decode")
    for case in (
        Decode(3, 2, 4, 64, 16, 6, torch.float32, splits=3, seed=6),
        Decode(2, 3, 3, 128, 16, 8, torch.bfloat16, splits=4, seed=7),
    ):
        with mock.patch.object(td, "_merge_splits", wraps=td._merge_splits) as merge:
            check_decode(case, "cpu")
        assert merge.call_count == case.batch * case.h_kv
    assert not td.arrival_counters(torch.device("cpu"), 1).any()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("case", GPU_DECODE, ids=str)
@on_gpu
def test_gpu_decode(case: Decode, fused: bool) -> None:
    check_decode(case, "cuda", fused)


@pytest.mark.parametrize("case", GPU_DECODE, ids=str)
@on_gpu
def test_gpu_decode_shifted(case: Decode) -> None:
    check_decode(case, "cuda", shifted=True)


@on_gpu
def test_gpu_decode_fused_repeated() -> None:
    """64 splits per (sequence, kv-head) racing on real hardware, twenty times: a merge that reads a
    partial before it is visible, or a counter left non-zero, shows in one of the repeats."""
    case = Decode(4, 2, 4, 128, 64, 128, torch.bfloat16, splits=64, seed=8)
    args = decode_inputs(case, "cuda")
    want = ref.paged_decode_attention(*args)
    td = triton_impl("triton_decode")
    for _ in range(20):
        with poisoned_outputs():
            close(td.paged_decode_attention(*args, n_splits=case.splits, fused=True), want, case.dtype)
    assert not td.arrival_counters(args[0].device, 1).any()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "plain"])
@on_gpu
def test_gpu_decode_chain_reads_the_previous_output(pdl: bool, fused: bool) -> None:
    """Ten decodes in a row, each one's query the previous one's output: a dependent launch that read
    its query before the previous kernel had written it would drift from the reference chain."""
    case = Decode(2, 3, 3, 64, 64, 1024, torch.bfloat16, splits=32, seed=9)
    q, *rest = decode_inputs(case, "cuda")
    td = triton_impl("triton_decode")
    got = want = q
    for _ in range(10):
        got = td.paged_decode_attention(got, *rest, n_splits=case.splits, fused=fused, pdl=pdl)
        want = ref.paged_decode_attention(want, *rest)
    close(got, want, case.dtype)


# -- chunked prefill ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prefill:
    t: int
    q_start: int
    h_kv: int
    group: int
    d: int
    c: int
    earlier: int
    """How many chunks before the query block's first chunk are listed (sinks, selected)."""
    dtype: torch.dtype
    seed: int = 0


def prefill_inputs(case: Prefill, device: str):
    """A gappy ascending chunk list: some earlier chunks plus every chunk the query block touches."""
    g = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    c, end = case.c, case.q_start + case.t
    own = list(range(case.q_start // c, (end - 1) // c + 1))
    earlier = sorted(rng.sample(range(own[0]), min(case.earlier, own[0])))
    chunk_index = torch.tensor(earlier + own, dtype=torch.int32)
    n = chunk_index.numel()
    slots = torch.randperm(n + 3, generator=g)[:n].int()
    pool = nan_pool(n + 3, 2, case.h_kv, c, case.d, case.dtype, "cpu")
    for i, (s, ci) in enumerate(zip(slots.tolist(), chunk_index.tolist(), strict=True)):
        written = min(c, end - ci * c) if i >= len(earlier) else c
        pool[s, 0, :, :, :written] = torch.randn(2, case.h_kv, written, case.d, generator=g).to(case.dtype)
    q = torch.randn(case.t, case.h_kv * case.group, case.d, generator=g).to(case.dtype)
    args = (q, pool, 0, slots, chunk_index, case.q_start, case.d**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def check_prefill(case: Prefill, device: str, shifted: bool = False, splits: int | None = None) -> None:
    args = prefill_inputs(case, device)
    rot = random_rot((args[3].numel(),), case.d, case.seed, device) if shifted else None
    with poisoned_outputs():
        out = triton_impl("triton_prefill").prefill_attention(*args, rot=rot, n_splits=splits)
    close(out, ref.prefill_attention(*args, rot=rot), case.dtype)


INTERP_PREFILL = [
    Prefill(5, 0, 1, 1, 64, 16, 0, torch.float32),
    Prefill(37, 21, 2, 3, 64, 16, 2, torch.float32),
    Prefill(19, 130, 1, 4, 128, 64, 1, torch.bfloat16),
    Prefill(64, 64, 1, 8, 64, 64, 1, torch.float16),
    Prefill(50, 97, 1, 3, 64, 16, 3, torch.bfloat16, seed=1),
    Prefill(1, 45, 2, 1, 128, 16, 1, torch.float16, seed=2),
]
GPU_PREFILL = [
    Prefill(4096, 0, 8, 4, 128, 64, 0, torch.bfloat16),
    Prefill(1000, 3001, 3, 3, 64, 64, 20, torch.bfloat16, seed=1),
    Prefill(333, 70000, 8, 4, 128, 64, 200, torch.float16, seed=2),
    Prefill(700, 129, 2, 8, 128, 16, 5, torch.float32, seed=3),
    Prefill(64, 4096, 4, 1, 64, 64, 60, torch.bfloat16, seed=4),
]


@interp
@pytest.mark.parametrize("case", INTERP_PREFILL, ids=str)
def test_interp_prefill(case: Prefill) -> None:
    check_prefill(case, "cpu")


@interp
@pytest.mark.parametrize("case", INTERP_PREFILL[1::2], ids=str)
def test_interp_prefill_shifted(case: Prefill) -> None:
    check_prefill(case, "cpu", shifted=True)


@interp
@pytest.mark.parametrize("shifted", [False, True], ids=["absolute", "shifted"])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_interp_prefill_splits(splits: int, shifted: bool) -> None:
    """The unmasked key tiles split between programs, merged by log-sum-exp: 2 tiles into 2, 3 and 7
    splits (the last ones empty), the masked tiles in the last split."""
    check_prefill(Prefill(37, 300, 2, 3, 64, 16, 9, torch.float32, seed=5), "cpu", shifted, splits)


@pytest.mark.parametrize("shifted", [False, True], ids=["absolute", "shifted"])
@pytest.mark.parametrize("case", GPU_PREFILL, ids=str)
@on_gpu
def test_gpu_prefill(case: Prefill, shifted: bool) -> None:
    check_prefill(case, "cuda", shifted)


@pytest.mark.parametrize("splits", [1, 5, 16])
@on_gpu
def test_gpu_prefill_splits(splits: int) -> None:
    """A 512-token step of SmolLM2's heads over 2,000 earlier chunks, at forced split counts."""
    check_prefill(Prefill(512, 128000, 3, 3, 64, 64, 2000, torch.bfloat16, seed=6), "cuda", splits=splits)


def batched_prefill_inputs(cases: list[Prefill], device: str, fp8: bool = False):
    """The pieces of one step, each `prefill_inputs` of its case (one h_kv, group, d, c and dtype),
    their chunks side by side in one pool and their queries in one tensor: the args of
    `prefill_attention_batched`, and each piece's args of `prefill_attention` alone."""
    alone = [prefill_inputs(c, "cpu") for c in cases]
    if fp8:  # queries in the case's dtype, KV fp8 from fp32 (as `check_prefill_fp8`)
        alone = [(q.to(c.dtype), fp8_pool(p), *rest) for c, (q, p, *rest) in zip(cases, alone, strict=True)]
    sizes = [a[1].shape[0] for a in alone]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    pool = torch.cat([a[1] for a in alone])
    pieces, row, listed = [], 0, 0
    for c, a in zip(cases, alone, strict=True):
        pieces.append([row, c.t, c.q_start, listed, a[3].numel()])
        row, listed = row + c.t, listed + a[3].numel()
    slots = torch.cat([a[3] + off for a, off in zip(alone, offsets, strict=True)]).int()
    index = torch.cat([a[4] for a in alone])
    q = torch.cat([a[0] for a in alone])
    args = (q, pool, 0, torch.tensor(pieces, dtype=torch.int32), slots, index, max(c.t for c in cases))
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    each = [(a[0].to(device), args[1], 0, (a[3] + off).int().to(device), a[4].to(device), c.q_start)
            for c, a, off in zip(cases, alone, offsets, strict=True)]  # fmt: skip
    return (*args, cases[0].d ** -0.5), each


def check_prefill_batched(cases: list[Prefill], device: str, fp8: bool = False) -> None:
    """One launch for every piece computes what each piece's own `prefill_attention` computes; the
    twin does too."""
    args, each = batched_prefill_inputs(cases, device, fp8)
    with poisoned_outputs():
        out = triton_impl("triton_prefill").prefill_attention_batched(*args)
    want = torch.cat([ref.prefill_attention(*a, args[-1]) for a in each])
    dtype = torch.bfloat16 if fp8 else cases[0].dtype
    close(out, want, dtype)
    close(ref.prefill_attention_batched(*args), want, dtype)


INTERP_BATCHED = [  # rows, first position and earlier chunks differ piece to piece; one piece of 1
    Prefill(5, 40, 2, 3, 64, 16, 1, torch.float32),
    Prefill(37, 21, 2, 3, 64, 16, 0, torch.float32, seed=1),
    Prefill(19, 130, 2, 3, 64, 16, 3, torch.float32, seed=2),
    Prefill(1, 77, 2, 3, 64, 16, 2, torch.float32, seed=3),
    Prefill(50, 0, 2, 3, 64, 16, 0, torch.float32, seed=4),
]


@interp
def test_interp_prefill_batched() -> None:
    check_prefill_batched(INTERP_BATCHED, "cpu")
    check_prefill_batched(INTERP_BATCHED[:2], "cpu", fp8=True)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@on_gpu
def test_gpu_prefill_batched(kv: str) -> None:
    """32 next turns over 8K-token contexts (SmolLM2's heads) and a few other shapes in one step."""
    turns = [Prefill(24 + 3 * i, 8192 + 40 * i, 3, 3, 64, 64, 120, torch.bfloat16, seed=i) for i in range(32)]
    check_prefill_batched(turns, "cuda", fp8=kv == "fp8")
    others = [
        Prefill(700, 129, 8, 4, 128, 64, 5, torch.bfloat16),
        Prefill(64, 4096, 8, 4, 128, 64, 60, torch.bfloat16, seed=1),
        Prefill(2, 70000, 8, 4, 128, 64, 200, torch.bfloat16, seed=2),
    ]
    check_prefill_batched(others, "cuda", fp8=kv == "fp8")


def _variants(kernel) -> int:
    """Variants of a Triton kernel compiled (or loaded from the cache) in this process."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@on_gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_warm_leaves_no_prefill_or_scoring_variant_to_compile(kv: str) -> None:
    """After `kernels.warm`, prefill and scoring calls of any length, slot count and rotation (what
    turns launch) compile nothing: none compiles on a turn's path (over bf16 KV, and fp8 KV)."""
    tp, ts = triton_impl("triton_prefill"), triton_impl("triton_scoring")
    hq, h_kv, c, d, n_slots = 9, 3, 64, 64, 96
    pool = torch.randn(n_slots, 2, 2, h_kv, c, d, device="cuda").to(torch.bfloat16)
    if kv == "fp8":
        pool = fp8_pool(pool)
    kernels.warm(pool, hq, torch.bfloat16)
    watched = (tp._prefill_kernel, tp._combine_kernel, ts._lse_kernel)
    before = [_variants(k) for k in watched]
    rng = random.Random(0)
    for t in [*rng.sample(range(1, 700), 30), 4096]:
        n = rng.randint(1, n_slots)
        slots = torch.tensor(rng.sample(range(n_slots), n), dtype=torch.int32, device="cuda")
        index = torch.arange(n, dtype=torch.int32, device="cuda")
        rot = torch.randn(n, 2, d // 2, device="cuda") if rng.random() < 0.5 else None
        q = torch.randn(t, hq, d, device="cuda").to(torch.bfloat16)
        kernels.prefill_attention(q, pool, 1, slots, index, rng.randint(0, n * c), d**-0.5, rot)
        kernels.chunk_lse(q[None, : min(t, 80)].expand(2, -1, -1, -1), pool, slots, rot)
        p = rng.randint(2, 40)  # pieces of t rows each over the same listing
        pieces = torch.tensor([[i * t, t, n * c, 0, n] for i in range(p)], dtype=torch.int32, device="cuda")
        kernels.prefill_attention_batched(q.repeat(p, 1, 1), pool, 1, pieces, slots, index, t, d**-0.5)
    torch.cuda.synchronize()
    assert [_variants(k) for k in watched] == before


def test_shifted_keys_sit_at_the_shifted_positions() -> None:
    """A key rotated to position p, then shifted by s, is the key rotated to p + s: the reference's
    rotation moves keys along RoPE positions (what cache positions rely on)."""
    from kvflash.models.rope import apply_rotary

    d, c, n = 64, 16, 3
    g = torch.Generator().manual_seed(0)
    k0 = torch.randn(n, c, 1, d, generator=g)
    inv = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    pos = torch.arange(n * c).float().view(n, c) + 1000
    shift = torch.tensor([700.0, 64.0, 0.0])

    def rope(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = torch.cat([p[:, None] * inv] * 2, -1)
        return ang.cos(), ang.sin()

    at = torch.stack([apply_rotary(k0[i], *rope(pos[i])) for i in range(n)])[:, :, 0]
    moved = torch.stack([apply_rotary(k0[i], *rope(pos[i] + shift[i])) for i in range(n)])[:, :, 0]
    ang = shift[:, None] * inv
    got = ref.shift_keys(at, torch.stack([ang.cos(), ang.sin()], -2))
    torch.testing.assert_close(got, moved, atol=2e-4, rtol=1e-4)


# -- summaries and scores -------------------------------------------------------------------------


def check_summaries(
    n: int, layers: int, h_kv: int, d: int, c: int, blocks: int, dtype: torch.dtype, device: str
) -> None:
    g = torch.Generator().manual_seed(n)
    pool = (torch.randn(n + 2, layers, 2, h_kv, c, d, generator=g) + 0.3).to(dtype).to(device)
    pool[:, :, 1] = float("nan")  # values are never read
    slots = torch.randperm(n + 2, generator=g)[:n].int().to(device)
    with poisoned_outputs():
        out = triton_impl("triton_scoring").chunk_summaries(pool, slots, blocks)
    close(out, ref.chunk_summaries(pool, slots, blocks), torch.float32)


@dataclass(frozen=True)
class Lse:
    layers: int
    t: int
    h_kv: int
    group: int
    n: int
    d: int
    c: int
    dtype: torch.dtype
    shifted: bool


def lse_inputs(case: Lse, device: str) -> tuple:
    """Every layer's queries (a strided view, as torch.stack of per-layer slices need not be dense),
    a pool whose values are NaN (never read) and n listed slots in random order, rotations if shifted."""
    g = torch.Generator().manual_seed(case.n + case.t)
    pool = torch.randn(case.n + 3, case.layers, 2, case.h_kv, case.c, case.d, generator=g).to(case.dtype)
    pool[:, :, 1] = float("nan")
    slots = torch.randperm(case.n + 3, generator=g)[: case.n].int()
    q = torch.randn(case.layers, case.t + 2, case.h_kv * case.group, case.d, generator=g)[:, 1:-1]
    rot = random_rot((case.n,), case.d, case.n, "cpu") if case.shifted else None
    return tuple(None if a is None else a.to(device) for a in (q, pool, slots, rot))


def check_lse(case: Lse, device: str) -> None:
    q, pool, slots, rot = lse_inputs(case, device)
    with poisoned_outputs():
        out = triton_impl("triton_scoring").chunk_lse(q, pool, slots, rot)
    close(out, ref.chunk_lse(q, pool, slots, rot), case.dtype)


INTERP_LSE = [
    Lse(1, 1, 1, 1, 1, 64, 16, torch.float32, False),
    Lse(2, 3, 3, 3, 5, 64, 16, torch.bfloat16, True),
    Lse(2, 8, 2, 8, 7, 128, 16, torch.float16, False),
    Lse(1, 37, 1, 4, 3, 64, 32, torch.float32, True),
]
GPU_LSE = [
    Lse(30, 32, 3, 3, 1000, 64, 64, torch.bfloat16, False),
    Lse(30, 32, 3, 3, 513, 64, 64, torch.bfloat16, True),
    Lse(32, 32, 8, 4, 257, 128, 64, torch.bfloat16, True),
    Lse(32, 1, 8, 4, 300, 128, 64, torch.float16, False),
    Lse(3, 17, 2, 8, 101, 128, 16, torch.float32, True),
]


@interp
@pytest.mark.parametrize(
    "n,layers,h_kv,d,c,blocks,dtype",
    [
        (1, 1, 1, 64, 16, 4, torch.float32),
        (5, 2, 3, 128, 64, 4, torch.bfloat16),
        (3, 3, 2, 64, 16, 1, torch.float16),
        (2, 2, 1, 64, 32, 8, torch.float32),
    ],
)
def test_interp_summaries(n, layers, h_kv, d, c, blocks, dtype) -> None:
    check_summaries(n, layers, h_kv, d, c, blocks, dtype, "cpu")


@interp
@pytest.mark.parametrize("case", INTERP_LSE, ids=str)
def test_interp_chunk_lse(case: Lse) -> None:
    check_lse(case, "cpu")


@on_gpu
def test_gpu_summaries() -> None:
    check_summaries(1000, 30, 3, 64, 64, 4, torch.bfloat16, "cuda")
    check_summaries(257, 32, 8, 128, 64, 2, torch.float16, "cuda")


@pytest.mark.parametrize("case", GPU_LSE, ids=str)
@on_gpu
def test_gpu_chunk_lse(case: Lse) -> None:
    check_lse(case, "cuda")


@pytest.mark.parametrize("case", GPU_LSE[1:3], ids=str)
@on_gpu
def test_gpu_chunk_lse_reads_pinned_host_memory_in_place(case: Lse) -> None:
    """The host tier's exact scoring: the kernel over a page-locked host block (registered as the
    host tier registers its blocks) equals the kernel over the same chunks on the device."""
    from kvflash.engine.host_tier import pinned_empty

    q, pool, slots, rot = lse_inputs(case, "cuda")
    host = pinned_empty(tuple(pool.shape), pool.dtype)
    host.copy_(pool.cpu())
    assert host.is_pinned()
    torch.testing.assert_close(
        kernels.chunk_lse_in_place(q, host, slots, rot),
        kernels.chunk_lse(q, pool, slots, rot),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("shifted", [False, True], ids=["plain", "shifted"])
def test_reference_chunk_lse_is_each_heads_logsumexp_over_its_kv_heads_keys(shifted: bool) -> None:
    """The twin against a loop: query head h of layer l scores chunk i by log Σ exp over the chunk's
    keys of its own kv-head h // G, each key moved by the chunk's rotation when one is given."""
    case = Lse(2, 3, 2, 3, 4, 32, 16, torch.float32, shifted)
    q, pool, slots, rot = lse_inputs(case, "cpu")
    out = ref.chunk_lse(q, pool, slots, rot)
    for i, slot in enumerate(slots.tolist()):
        keys = pool[slot, :, 0]  # [L, Hkv, C, D]
        if rot is not None:
            keys = ref.shift_keys(keys, rot[i].expand(*keys.shape[:2], *rot.shape[1:]))
        for h in range(case.h_kv * case.group):
            want = torch.logsumexp(q[:, :, h] @ keys[:, h // case.group].transpose(1, 2) / case.d**0.5, -1)
            torch.testing.assert_close(out[:, :, h, i], want, atol=1e-5, rtol=1e-5)


# -- copies ---------------------------------------------------------------------------------------


def check_write(t: int, h_kv: int, d: int, c: int, dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(t)
    pool = nan_pool(t // c + 3, 2, h_kv, c, d, dtype, device)
    where = torch.randperm(pool.shape[0] * c, generator=g)[:t]
    slot, offset = (where // c).int().to(device), (where % c).int().to(device)
    k, v = torch.randn(2, t, h_kv, d, generator=g).to(dtype).to(device)
    want = pool.clone()
    ref.write_tokens(want, 1, slot, offset, k, v)
    triton_impl("triton_copy").write_tokens(pool, 1, slot, offset, k, v)
    torch.testing.assert_close(pool, want, rtol=0, atol=0, equal_nan=True)


@interp
@pytest.mark.parametrize(
    "t,h_kv,d,c,dtype",
    [(1, 1, 64, 16, torch.float32), (37, 3, 64, 16, torch.bfloat16), (9, 8, 128, 64, torch.float16)],
)
def test_interp_write_tokens(t, h_kv, d, c, dtype) -> None:
    check_write(t, h_kv, d, c, dtype, "cpu")


@interp
@pytest.mark.parametrize(
    "kv_dtype,chunk,n_ids",
    [("fp32", 16, 160), ("fp8", 16, 160), ("fp8", 64, 200)],
    ids=["fp32", "fp8", "fp8-within-budget"],
)
def test_interp_sequence_decodes_through_the_kernels_as_through_the_reference(
    kv_dtype: str, chunk: int, n_ids: int
) -> None:
    """A sequence decodes through the kernels (forced on, as on CUDA) to the reference path's logits:
    the decode buffers (slot table padded to the budget, the step's inputs sent in one copy), chunk
    boundaries and re-selections every 8 tokens; larger than its budget, rotated keys; fp8 KV
    written by the kernels (scales included) as by the twins. Within its budget over 64-token fp8
    chunks, each decode program serves both kv-heads (`decode_heads`)."""
    from kvflash.config import EngineConfig, ResidencyConfig
    from kvflash.engine.engine import Engine
    from kvflash.models.loader import LoadedModel
    from tests.tiny import tiny_config, tiny_model

    cfg = tiny_config()
    lm = LoadedModel(tiny_model(cfg), None, cfg, Path("tiny"), torch.float32, torch.device("cpu"))
    res = ResidencyConfig(chunk_tokens=chunk, tail_chunks=1, tau=8, tau_history_div=1 << 30)
    ids = torch.randint(0, cfg.vocab_size, (n_ids,), generator=torch.Generator().manual_seed(0)).tolist()
    evicts = n_ids + 24 > 6 * chunk
    group = cfg.n_heads // cfg.n_kv_heads
    stacks = triton_impl("triton_decode").decode_heads(cfg.n_kv_heads, group, cfg.head_dim, chunk, 1, evicts)
    assert evicts or (kv_dtype == "fp8" and stacks > 1)
    tokens: list[int] = []
    runs = []
    for forced in (False, True):
        force = mock.patch.object(kernels, "uses_triton", return_value=True)
        with force if forced else contextlib.nullcontext():
            eng = Engine(lm, EngineConfig(pool_tokens=1024, residency=res, kv_dtype=kv_dtype))
            kv = eng.new_sequence(6 * chunk)
            logits, step, out = eng.prefill(kv, ids), eng.decode_step(kv), []
            for i, pos in enumerate(range(len(ids), len(ids) + 24)):
                if not forced:
                    tokens.append(int(logits.argmax()))
                logits = step(tokens[i], pos)
                out.append(logits)
            assert kv.uses_triton == forced
            assert not forced or kv.staging.rotated == evicts  # chunks evicted between resident ones
        runs.append(torch.stack(out))
    torch.testing.assert_close(
        runs[1], runs[0], **TOL[torch.float32 if kv_dtype == "fp32" else torch.bfloat16]
    )


@interp
def test_interp_batched_decode_attends_in_one_call_as_each_sequence_alone() -> None:
    """The scheduler's batched decode on the kernels (forced on, as on CUDA): each layer of every step,
    re-selections (every 8 tokens) included, attends for the whole batch in one call, over stacked
    slot tables mixing rotated and unrotated keys, and every sequence's logits equal its own decode
    step's: the re-selecting sequences score from the batch's queries what they score alone."""
    from kvflash.models.loader import LoadedModel
    from tests.test_scheduler import BATCH_STEPS, CFG, batched_against_alone
    from tests.tiny import tiny_model

    lm = LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, torch.device("cpu"))
    batches, real = [], kernels.paged_decode_attention

    def spy(q: torch.Tensor, *args, **kw) -> torch.Tensor:
        batches.append(q.shape[0])
        return real(q, *args, **kw)

    with (
        mock.patch.object(kernels, "uses_triton", return_value=True),
        mock.patch.object(kernels, "paged_decode_attention", spy),
    ):
        batched_against_alone(lm)
    assert batches.count(3) == BATCH_STEPS * CFG.n_layers, "every batched step attended in one call a layer"


@on_gpu
def test_gpu_copies() -> None:
    check_write(1, 8, 128, 64, torch.bfloat16, "cuda")
    check_write(2049, 3, 64, 64, torch.bfloat16, "cuda")


# -- a layer's small ops --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    t: int
    hidden: int
    hq: int
    h_kv: int
    d: int
    inter: int
    dtype: torch.dtype


def check_layer_ops(case: Layer, device: str) -> None:
    g = torch.Generator().manual_seed(case.t + case.hidden)
    pw, dt = triton_impl("triton_pointwise"), case.dtype

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt).to(device)

    x, res, w = rand(case.t, case.hidden), rand(case.t, case.hidden), 1 + 0.1 * rand(case.hidden)
    for residual in (None, res):
        with poisoned_outputs():
            out, summed = pw.rms_norm(x, w, 1e-5, residual)
        want, want_sum = ref.rms_norm(x, w, 1e-5, residual)
        close(out, want, dt)
        close(summed, want_sum, dt)
        # one rounding of an fp32 sum on both paths (the interpreter truncates to bf16 instead)
        assert device != "cuda" or torch.equal(summed, want_sum)

    sizes = [case.hq * case.d, case.h_kv * case.d, case.h_kv * case.d]
    qkv = rand(case.t, sum(sizes))
    before = qkv.clone()
    q, k, _ = (p.view(case.t, -1, case.d) for p in qkv.split(sizes, dim=-1))
    inv = 1.0 / 10000 ** (torch.arange(0, case.d, 2) / case.d)
    ang = torch.randint(0, 1 << 17, (case.t,), generator=g)[:, None] * inv
    cos, sin = (f(torch.cat([ang, ang], -1)).to(device) for f in (torch.cos, torch.sin))
    want_q, want_k = ref.rotary_qk(q, k, cos, sin)
    assert pw.rotary_qk(q, k, cos, sin)[0] is q, "turned in place"
    close(q, want_q, dt)
    close(k, want_k, dt)
    assert torch.equal(qkv[:, sizes[0] + sizes[1] :], before[:, sizes[0] + sizes[1] :]), "v untouched"

    gate_up = rand(case.t, 2 * case.inter)
    with poisoned_outputs():
        act = pw.silu_mul(gate_up)
    close(act, ref.silu_mul(gate_up), dt)


@interp
@pytest.mark.parametrize(
    "case",
    [Layer(1, 576, 9, 3, 64, 1536, torch.float32), Layer(5, 64, 4, 1, 16, 40, torch.bfloat16)],
    ids=str,
)
def test_interp_layer_ops(case: Layer) -> None:
    check_layer_ops(case, "cpu")


@on_gpu
@pytest.mark.parametrize(
    "case",
    [
        Layer(1, 576, 9, 3, 64, 1536, torch.bfloat16),
        Layer(300, 576, 9, 3, 64, 1536, torch.bfloat16),
        Layer(1, 4096, 32, 8, 128, 14336, torch.bfloat16),
        Layer(77, 4096, 32, 8, 128, 14336, torch.float16),
    ],
    ids=str,
)
def test_gpu_layer_ops(case: Layer) -> None:
    check_layer_ops(case, "cuda")


# -- fp8 pools ------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def fp8_pool(pool: torch.Tensor) -> torch.Tensor:
    """An fp8 pool of pool's values (NaN where they are NaN): each (slot, layer, K/V, kv-head) block
    quantised with its own scale, its largest finite magnitude / 448, in the block's extra row; V
    blocks channel-major (`_common.fp8_v_tokens`)."""
    out = torch.zeros(*pool.shape[:-2], pool.shape[-2] + 1, pool.shape[-1], dtype=FP8, device=pool.device)
    ref.fp8_whole_chunks(pool, out)
    return out


def with_fp8_pool(args: tuple) -> tuple:
    return (args[0], fp8_pool(args[1]), *args[2:])


def check_decode_fp8(case: Decode, device: str, fused: bool = True, shifted: bool = False) -> None:
    """case.dtype is the queries' (bf16 as on CUDA, fp32 where the dots must be exact)."""
    q, *rest = decode_inputs(dataclasses.replace(case, dtype=torch.float32), device)
    args = with_fp8_pool((q.to(case.dtype), *rest))
    rot = random_rot((case.batch, case.max_n), case.d, case.seed, device) if shifted else None
    with poisoned_outputs():
        out = triton_impl("triton_decode").paged_decode_attention(
            *args, n_splits=case.splits, fused=fused, rot=rot
        )
    close(out, ref.paged_decode_attention(*args, rot=rot), torch.bfloat16)


def check_prefill_fp8(case: Prefill, device: str, shifted: bool = False) -> None:
    q, *rest = prefill_inputs(dataclasses.replace(case, dtype=torch.float32), device)
    args = with_fp8_pool((q.to(case.dtype), *rest))
    rot = random_rot((args[3].numel(),), case.d, case.seed, device) if shifted else None
    with poisoned_outputs():
        out = triton_impl("triton_prefill").prefill_attention(*args, rot=rot)
    close(out, ref.prefill_attention(*args, rot=rot), torch.bfloat16)


def check_scoring_fp8(case: Lse, device: str, blocks: int = 4) -> None:
    q, pool, slots, rot = lse_inputs(dataclasses.replace(case, dtype=torch.float32), device)
    pool = fp8_pool(pool)
    scoring = triton_impl("triton_scoring")
    with poisoned_outputs():
        lse, summaries = scoring.chunk_lse(q, pool, slots, rot), scoring.chunk_summaries(pool, slots, blocks)
    # the kernel's dots over widened keys are TF32, as for a bf16 pool; the twin's are fp32
    close(lse, ref.chunk_lse(q, pool, slots, rot), torch.float16)
    close(summaries, ref.chunk_summaries(pool, slots, blocks), torch.float32)


def check_write_fp8(runs: list[tuple[int, int, int]], h_kv: int, d: int, c: int, device: str) -> None:
    """Writes of runs (slot, first offset, tokens), one launch for all, then one token more into the
    first run's chunk (which has room for it): bit for bit what the twin writes, scales included."""
    g = torch.Generator().manual_seed(len(runs))
    pool = fp8_pool(torch.randn(8, 2, 2, h_kv, c, d, generator=g)).to(device)
    slot = torch.tensor([s for s, o, n in runs for _ in range(n)], dtype=torch.int32, device=device)
    offset = torch.tensor([o + i for s, o, n in runs for i in range(n)], dtype=torch.int32, device=device)
    k, v = torch.randn(2, slot.numel(), h_kv, d, generator=g) * torch.tensor([1.0, 30.0])[:, None, None, None]
    want = pool.clone()
    s0, o0, n0 = runs[0]
    assert o0 + n0 < c
    more = (
        torch.tensor([s0], dtype=torch.int32, device=device),
        torch.tensor([o0 + n0], dtype=torch.int32, device=device),
    )
    for fn, p in ((ref.write_tokens, want), (triton_impl("triton_copy").write_tokens, pool)):
        fn(p, 1, slot, offset, k.to(device), v.to(device))
        fn(p, 1, *more, 8 * k[:1].to(device), v[:1].to(device))
    scales, want_scales = kernels._common.fp8_scales(pool), kernels._common.fp8_scales(want)
    assert torch.equal(scales, want_scales), (scales - want_scales).abs().max()
    body, want_body = pool[..., :-1, :], want[..., :-1, :]
    off = (body.view(torch.uint8) != want_body.view(torch.uint8)).nonzero()
    assert not len(off), (len(off), off[:4].tolist(), body[tuple(off[:4].T)], want_body[tuple(off[:4].T)])


def check_fp8_v_layout(write_tokens, device: str) -> None:
    """After a run that begins a chunk and tokens written one at a time after it, a V block's first
    C x D bytes hold token t of channel d at byte d * C + t, a K block's at t * D + d: each the e4m3
    of the value over its block's scale."""
    c, h_kv, d, i32 = 16, 2, 32, torch.int32
    g = torch.Generator().manual_seed(5)
    pool = torch.zeros(3, 2, 2, h_kv, c + 1, d, dtype=FP8, device=device)
    x = torch.randn(c, 2, h_kv, d, generator=g)  # [T, K/V, Hkv, D]
    run = c - 3
    writes = [(0, run)] + [(t, t + 1) for t in range(run, c)]
    for lo, hi in writes:
        slot, offset = (torch.tensor(a, dtype=i32, device=device) for a in ([2] * (hi - lo), range(lo, hi)))
        k, v = x[lo:hi].to(device).unbind(1)
        write_tokens(pool, 1, slot, offset, k, v)
    blocks = pool[2, 1].cpu()  # [2, Hkv, C + 1, D]
    scales = kernels._common.fp8_scales(blocks)  # [2, Hkv]
    want = ref.quantize_fp8(x.permute(1, 2, 0, 3), scales[..., None, None]).view(torch.uint8)
    flat = blocks[:, :, :c].reshape(2, h_kv, c * d).view(torch.uint8)
    t, ch = torch.arange(c)[:, None], torch.arange(d)[None, :]
    assert torch.equal(flat[0][:, t * d + ch], want[0])
    assert torch.equal(flat[1][:, ch * c + t], want[1])


def test_fp8_write_tokens_stores_v_channel_major() -> None:
    check_fp8_v_layout(ref.write_tokens, "cpu")


@interp
def test_interp_write_tokens_fp8_v_channel_major() -> None:
    check_fp8_v_layout(triton_impl("triton_copy").write_tokens, "cpu")


INTERP_DECODE_FP8 = [
    Decode(2, 2, 3, 64, 16, 5, torch.float32, splits=3),
    Decode(3, 1, 4, 128, 64, 3, torch.bfloat16),
    Decode(2, 3, 3, 64, 16, 9, torch.bfloat16, splits=1, seed=1),
    Decode(1, 2, 3, 64, 64, 3, torch.bfloat16, seed=2),  # one chunk a tile: the scales are scalars
]
INTERP_DECODE_FP8_STACKED = [  # kv-heads a program (`decode_heads`): three (2 + 1); four; two; six (4 + 2)
    Decode(2, 3, 3, 64, 64, 5, torch.bfloat16, splits=2),
    Decode(3, 4, 2, 64, 64, 4, torch.float32, splits=1),
    Decode(1, 2, 8, 64, 64, 3, torch.bfloat16, seed=3),
    Decode(32, 4, 4, 128, 64, 3, torch.bfloat16, splits=2, seed=4),  # head_dim 128: two, from batch 32
    Decode(2, 6, 2, 32, 64, 4, torch.bfloat16, splits=2, seed=5),
]
INTERP_PREFILL_FP8 = [
    Prefill(37, 21, 2, 3, 64, 16, 2, torch.float32),
    Prefill(19, 130, 1, 4, 128, 64, 1, torch.bfloat16),
    Prefill(50, 97, 1, 3, 64, 16, 3, torch.bfloat16, seed=1),
]
GPU_DECODE_FP8 = [
    Decode(16, 8, 4, 128, 64, 1024, torch.bfloat16),
    Decode(16, 3, 3, 64, 64, 2048, torch.bfloat16, seed=1),
    Decode(1, 8, 4, 128, 64, 4096, torch.bfloat16, seed=2),
    Decode(33, 3, 3, 64, 64, 301, torch.bfloat16, seed=3),
    Decode(16, 3, 3, 64, 16, 1024, torch.bfloat16, seed=4),  # four chunks a tile
    Decode(3, 4, 4, 128, 32, 700, torch.bfloat16, seed=5),  # two chunks a tile, below batch 16
    Decode(40, 8, 4, 128, 64, 700, torch.bfloat16, seed=6),  # two kv-heads a program
    Decode(16, 2, 8, 64, 64, 1024, torch.bfloat16, seed=7),  # two kv-heads of eight queries, one stack
    Decode(16, 6, 2, 32, 64, 1024, torch.bfloat16, seed=8),  # six kv-heads, two stacks (4 + 2)
]
GPU_PREFILL_FP8 = [
    Prefill(4096, 0, 8, 4, 128, 64, 0, torch.bfloat16),
    Prefill(1000, 3001, 3, 3, 64, 64, 20, torch.bfloat16, seed=1),
    Prefill(512, 128000, 3, 3, 64, 64, 2000, torch.bfloat16, seed=6),
]


@interp
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("case", INTERP_DECODE_FP8, ids=str)
def test_interp_decode_fp8(case: Decode, fused: bool) -> None:
    check_decode_fp8(case, "cpu", fused)
    check_decode_fp8(case, "cpu", fused, shifted=True)


@interp
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("case", INTERP_DECODE_FP8_STACKED, ids=str)
def test_interp_decode_fp8_stacks_kv_heads(case: Decode, fused: bool) -> None:
    """An fp8 program serves several kv-heads (their queries block-diagonal, each output its own
    head's rows) as the twin attends each head alone: head_dim 32 and 64, and 128 from batch 32."""
    td = triton_impl("triton_decode")
    assert td.decode_heads(case.h_kv, case.group, case.d, case.c, 1, rotated=False, batch=case.batch) > 1
    check_decode_fp8(case, "cpu", fused)


@interp
def test_a_program_stacks_kv_heads_in_at_most_two_stacks_of_a_power_of_two() -> None:
    """Tiles are powers of two: seven heads (4 + 3) would need a third stack, so a program takes one
    of them; six take two stacks (4 + 2), three (SmolLM2's) 2 + 1."""
    decode_heads = triton_impl("triton_decode").decode_heads
    assert decode_heads(7, 2, 32, 64, 1, rotated=False, batch=16) == 1
    assert decode_heads(6, 2, 32, 64, 1, rotated=False, batch=16) == 6
    assert decode_heads(3, 3, 64, 64, 1, rotated=False, batch=16) == 3


@interp
def test_only_a_program_of_several_kv_heads_takes_the_register_cap() -> None:
    """The cap is measured for SmolLM2's stacked program; a one-head program (rotated chunks walk
    one head at a time) under it would take more registers than it wants, fewer programs an SM."""
    td = triton_impl("triton_decode")
    q, *rest = decode_inputs(Decode(16, 3, 3, 64, 64, 4, torch.float32), "cpu")
    pool = with_fp8_pool((q, *rest))[1]
    cap = td.decode_launch(64, 16, 1).max_registers
    assert cap is not None
    assert td.decode_grid(pool, 16, 9, 4, False, q.device)[::3] == (3, cap)
    assert td.decode_grid(pool, 16, 9, 4, True, q.device)[::3] == (1, None)


@interp
@pytest.mark.parametrize("case", INTERP_PREFILL_FP8, ids=str)
def test_interp_prefill_fp8(case: Prefill) -> None:
    check_prefill_fp8(case, "cpu")
    check_prefill_fp8(case, "cpu", shifted=True)


@interp
@pytest.mark.parametrize("case", INTERP_LSE[1:], ids=str)
def test_interp_scoring_fp8(case: Lse) -> None:
    check_scoring_fp8(case, "cpu")


@interp
@pytest.mark.parametrize(
    "runs,h_kv,d,c",
    [
        ([(5, 9, 3), (1, 0, 16), (3, 0, 5)], 3, 64, 16),  # a chunk continued, one whole, one begun
        ([(2, 0, 1), (4, 7, 1), (6, 0, 1)], 8, 128, 64),  # decode rows: one token per sequence
        ([(1, 0, 30), (0, 0, 64), (7, 0, 64)], 1, 64, 64),
    ],
)
def test_interp_write_tokens_fp8(runs, h_kv: int, d: int, c: int) -> None:
    check_write_fp8(runs, h_kv, d, c, "cpu")


def test_fp8_write_sets_scales_from_the_run_that_begins_a_chunk() -> None:
    """A whole chunk written at once takes its exact largest magnitude / 448 (no value clamped); a
    chunk begun by fewer tokens takes FP8_HEADROOM times theirs; later tokens use the stored scale
    and are clamped at 448 x scale; every value within 2^-4 of its block's largest magnitude."""
    from kvflash.kernels._common import FP8_HEADROOM, fp8_scales

    c, h_kv, d = 16, 2, 16
    g = torch.Generator().manual_seed(0)
    pool = torch.zeros(3, 1, 2, h_kv, c + 1, d, dtype=FP8)
    k, v = torch.randn(2, c + 2, h_kv, d, generator=g)
    i32 = torch.int32
    ref.write_tokens(
        pool, 0, torch.tensor([0] * c + [1, 1], dtype=i32), torch.tensor([*range(c), 0, 1], dtype=i32), k, v
    )
    whole = torch.stack([k[:c], v[:c]]).abs().amax((1, 3))  # [2, Hkv]
    begun = torch.stack([k[c:], v[c:]]).abs().amax((1, 3))
    torch.testing.assert_close(fp8_scales(pool)[0, 0], whole / 448, rtol=1e-6, atol=0)
    torch.testing.assert_close(fp8_scales(pool)[1, 0], begun * FP8_HEADROOM / 448, rtol=1e-6, atol=0)
    got = ref.kv_values(pool[0, 0])  # [2, Hkv, C, D]
    want = torch.stack([k[:c], v[:c]]).transpose(1, 2)
    assert ((got - want).abs() <= whole[..., None, None] / 16).all()
    big = torch.full((1, h_kv, d), 1e6)
    ref.write_tokens(pool, 0, torch.tensor([1], dtype=i32), torch.tensor([2], dtype=i32), big, -big)
    assert torch.equal(
        ref.kv_values(pool[1, 0])[:, :, 2],
        448 * fp8_scales(pool)[1, 0][..., None].expand(2, h_kv, d) * torch.tensor([1.0, -1.0])[:, None, None],
    )


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-kernel"])
@pytest.mark.parametrize("case", GPU_DECODE_FP8, ids=str)
@on_gpu
def test_gpu_decode_fp8(case: Decode, fused: bool) -> None:
    check_decode_fp8(case, "cuda", fused)
    check_decode_fp8(case, "cuda", fused, shifted=True)


@pytest.mark.parametrize("case", GPU_PREFILL_FP8, ids=str)
@on_gpu
def test_gpu_prefill_fp8(case: Prefill) -> None:
    check_prefill_fp8(case, "cuda")
    check_prefill_fp8(case, "cuda", shifted=True)


@pytest.mark.parametrize("case", GPU_LSE[:3], ids=str)
@on_gpu
def test_gpu_scoring_fp8(case: Lse) -> None:
    check_scoring_fp8(case, "cuda")


@on_gpu
def test_gpu_write_tokens_fp8() -> None:
    check_fp8_v_layout(triton_impl("triton_copy").write_tokens, "cuda")
    check_write_fp8([(5, 13, 40), (1, 0, 64), (3, 0, 64), (2, 0, 17)], 3, 64, 64, "cuda")
    check_write_fp8([(s, o, 1) for s, o in ((0, 0), (1, 5), (2, 63), (3, 0), (4, 1))], 8, 128, 64, "cuda")


# -- what only a GPU would refuse, compiled for one here --------------------------------------------


def fp8_launches_compile_for_hopper(h_kv: int, group: int, d: int, c: int, warm: Callable) -> None:
    """Every launch that `warm(pool, hq)` makes over an fp8 pool of this shape, one of each
    variant, compiles for sm_90 (`kvflash.kernels.hopper`: what the interpreter cannot refuse)."""
    from kvflash.kernels.hopper import compile_for_hopper, launches_as_on_hopper

    pool = fp8_pool(torch.zeros(2, 1, 2, h_kv, c, d))
    with launches_as_on_hopper() as launches:
        warm(pool, h_kv * group)
    variants = {}
    for launch in launches:
        fn, args, kw = launch
        if any(isinstance(a, torch.Tensor) and a.dtype == FP8 for a in args):
            unset = [name for name, a in zip(fn.arg_names, args, strict=False) if a is None]
            settings = ", ".join(f"{k}={v}" for k, v in kw.items())
            key = f"{fn.fn.__name__}({settings}; None: {', '.join(unset)})"
            variants.setdefault(key, launch)
    assert variants
    failed = []
    for key, launch in variants.items():
        try:
            compile_for_hopper(launch)
        except Exception as e:  # noqa: BLE001 (each failure is reported with its variant)
            while e.__cause__ is not None:  # the compiler's own complaint, under the source excerpts
                e = e.__cause__
            failed.append(f"{key}: {type(e).__name__}: {e}"[:400])
    assert not failed, f"{len(failed)} of {len(variants)} variants do not compile:\n" + "\n".join(failed)


hopper = pytest.mark.skipif(
    INTERPRET or not HAVE_TRITON, reason="compiles for the GPU (triton, not its interpreter)"
)
FP8_SHAPES = {"d64": (3, 3, 64), "d128": (8, 4, 128)}


@hopper
@pytest.mark.parametrize("shape", FP8_SHAPES)
@pytest.mark.parametrize("c", [16, 32, 64])
def test_fp8_decode_variants_compile_for_hopper(shape: str, c: int) -> None:
    """The decode kernel as the engine's warm-up launches it: each batch size to 64, keys rotated
    or not (a rotated chunk is a tile of its own, so 16 and 32 tokens reach the dots alone)."""
    decode = triton_impl("triton_decode").warm_decode
    fp8_launches_compile_for_hopper(
        *FP8_SHAPES[shape], c, lambda pool, hq: decode(pool, hq, torch.bfloat16, 64, 64)
    )


@hopper
@pytest.mark.parametrize(("shape", "c"), [("d64", 16), ("d128", 64)])
def test_fp8_prefill_scoring_and_write_variants_compile_for_hopper(shape: str, c: int) -> None:
    """Prefill (each query tile, keys rotated or not, split or batched), scoring and the write, over
    chunks of several a tile and of one."""

    def warm(pool: torch.Tensor, hq: int) -> None:
        triton_impl("triton_prefill").warm_prefill(pool, hq, torch.bfloat16)
        triton_impl("triton_scoring").warm_lse(pool, hq, torch.bfloat16)
        h_kv, d, slot = pool.shape[3], pool.shape[5], torch.zeros(3, dtype=torch.int32)
        k = torch.zeros(3, h_kv, d)
        triton_impl("triton_copy").write_tokens(pool, 0, slot, torch.arange(3, dtype=torch.int32), k, k)

    fp8_launches_compile_for_hopper(*FP8_SHAPES[shape], c, warm)


@hopper
@pytest.mark.parametrize(("shape", "kv"), [("d64", "bf16"), ("d128", "fp8")])
def test_decode_rows_of_any_batch_launch_only_variants_the_warm_up_launched(shape: str, kv: str) -> None:
    """A mixed step's decode rows launch the decode kernel eagerly, its valid lengths and listed
    chunks read from rows of the batch's one staged int32 buffer (`Staged`): for every batch size to
    40 the variant an H200 would run is one `warm_decode` launched, so none compiles in a turn. With
    rows at offsets that moved with the batch size, 3, 5, 6, 7, 9, ... rows launched variants of
    their own (a pointer not 16-byte aligned)."""
    from kvflash.engine.decode_staging import DECODE_FIELDS, Staged
    from kvflash.kernels.hopper import launches_as_on_hopper, variant_of

    h_kv, group, d = FP8_SHAPES[shape]
    width, most = 24, 40
    pool = torch.zeros(2, 1, 2, h_kv, 64, d, dtype=torch.bfloat16)
    pool = fp8_pool(pool) if kv == "fp8" else pool
    td = triton_impl("triton_decode")
    with launches_as_on_hopper() as launches:
        td.warm_decode(pool, h_kv * group, torch.bfloat16, most, width)
    warmed = {variant_of(launch) for launch in launches}
    q = torch.zeros(most, h_kv * group, d, dtype=torch.bfloat16)
    table = torch.zeros(most, width, dtype=torch.int32)
    missed = []
    for rows in range(1, most + 1):
        fields = Staged((DECODE_FIELDS, rows), torch.device("cpu")).device
        with launches_as_on_hopper() as launches:
            td.paged_decode_attention(q[:rows], pool, 0, table[:rows], fields[4], fields[5], 0.125)
        missed += [rows for launch in launches if variant_of(launch) not in warmed]
    assert not missed


# -- the twins against plain SDPA, and dispatch ---------------------------------------------------


def test_reference_decode_equals_contiguous_sdpa() -> None:
    case = Decode(4, 2, 3, 64, 16, 6, torch.float32, seed=7)
    q, pool, layer, table, n, last_valid, scale = decode_inputs(case, "cpu")
    out = ref.paged_decode_attention(q, pool, layer, table, n, last_valid, scale)
    for b in range(case.batch):
        kv = pool[table[b, : n[b]].long(), layer]  # [n, 2, Hkv, C, D]
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, case.h_kv, -1, case.d)
        kv = kv[:, :, : (int(n[b]) - 1) * case.c + int(last_valid[b])]
        want = F.scaled_dot_product_attention(q[b, :, None], kv[0], kv[1], scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[b], want[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_start", [0, 37])
def test_reference_prefill_equals_contiguous_sdpa(q_start: int) -> None:
    case = Prefill(50, q_start, 2, 4, 64, 16, 100, torch.float32, seed=3)
    q, pool, layer, slots, chunk_index, _, scale = prefill_inputs(case, "cpu")
    assert chunk_index.tolist() == list(range(chunk_index.numel())), "every earlier chunk is listed"
    out = ref.prefill_attention(q, pool, layer, slots, chunk_index, q_start, scale)
    kv = pool[slots.long(), layer].permute(1, 2, 0, 3, 4).reshape(2, case.h_kv, -1, case.d)
    kv = kv[:, :, : q_start + case.t]
    mask = torch.arange(q_start + case.t)[None, :] <= torch.arange(q_start, q_start + case.t)[:, None]
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(out, want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_dispatch_runs_the_twin_off_cuda() -> None:
    args = decode_inputs(Decode(2, 1, 3, 64, 16, 3, torch.float32), "cpu")
    assert not kernels.uses_triton(args[0], head_dim=64, chunk_tokens=16)
    assert torch.equal(kernels.paged_decode_attention(*args), ref.paged_decode_attention(*args))


@on_gpu
def test_dispatch_on_cuda(monkeypatch) -> None:
    t = torch.zeros(1, device="cuda")
    assert kernels.uses_triton(t, head_dim=128, chunk_tokens=64)
    assert not kernels.uses_triton(t, head_dim=80, chunk_tokens=64)
    assert not kernels.uses_triton(t, head_dim=128, chunk_tokens=48)
    monkeypatch.setenv("KVFLASH_KERNELS", "torch")
    assert not kernels.uses_triton(t, head_dim=128, chunk_tokens=64)


@pytest.mark.skipif(INTERPRET or not HAVE_TRITON, reason="this is the interpreter run, or no triton")
@pytest.mark.skipif(CUDA, reason="with CUDA the kernels are tested compiled, at real sizes (-m gpu)")
def test_kernels_under_interpreter() -> None:
    """Runs the `interp` cases of this file in a fresh process with the Triton interpreter on.

    It needs a Triton whose interpreter works with the installed numpy (3.9 does; 3.6 fails on
    numpy >= 2.4), which is one more reason to leave it to CPU-only machines."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVFLASH_KERNELS": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k"]
    # Two processes, one a core: the interpreter runs on one thread, and the batched case alone
    # takes about as long as all the others.
    halves = [f"interp and {'' if first else 'not '}batched_decode" for first in (True, False)]
    procs = [
        subprocess.Popen([*cmd, k], env=env, cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for k in halves
    ]  # fmt: skip
    for proc in procs:
        out, err = proc.communicate()
        assert proc.returncode == 0, out[-6000:] + err[-2000:]
