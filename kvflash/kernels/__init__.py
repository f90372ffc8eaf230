"""Kernels over the chunk pool (docs/DESIGN.md: Kernels): Triton on CUDA, the torch reference twins elsewhere.

Each call picks its implementation from its arguments: Triton when every tensor is on CUDA, triton
imports and the pool's shape suits the kernels (power-of-two chunk_tokens and head_dim >= 16);
otherwise the twin in `reference`. A pool of fp8 KV (`float8_e4m3fn`, its scales in an extra row
of each block, V blocks channel-major: kvflash/engine/pool.py, `slot_shape`) goes through the same
calls. `KVFLASH_KERNELS=torch` forces the twins, to bisect a numerical difference. Triton is
imported only on first CUDA use, so CPU-only runs never pay for it.

The kernels are not specialised on the counts and offsets that change from call to call (tokens of
a step, slots listed, splits, a table's width): Triton would otherwise compile a kernel again for
each new combination of their divisibility by 16, on the request path of a serving process. For the
same reason the int32 fields a batch's decode rows read start 16-byte aligned whatever the batch size
(`engine.decode_staging.Staged`): Triton specialises a pointer on its alignment. `variants.built`
counts what is built all the same.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable

import torch

from kvflash.kernels import reference, variants
from kvflash.kernels._common import chunk_tokens, pow2

__all__ = [
    "chunk_lse",
    "chunk_lse_in_place",
    "chunk_summaries",
    "paged_decode_attention",
    "prefill_attention",
    "prefill_attention_batched",
    "rms_norm",
    "rotary_qk",
    "silu_mul",
    "start_cache_key",
    "uses_triton",
    "variants",
    "warm",
    "write_tokens",
]

_MODULE = {
    "paged_decode_attention": "triton_decode",
    "prefill_attention": "triton_prefill",
    "prefill_attention_batched": "triton_prefill",
    "chunk_summaries": "triton_scoring",
    "chunk_lse": "triton_scoring",
    "write_tokens": "triton_copy",
    "rms_norm": "triton_pointwise",
    "rotary_qk": "triton_pointwise",
    "silu_mul": "triton_pointwise",
}


@functools.cache
def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_ok(*tensors: torch.Tensor) -> bool:
    return (
        os.environ.get("KVFLASH_KERNELS", "").lower() != "torch"
        and all(t.is_cuda for t in tensors)
        and _have_triton()
    )


def uses_triton(*tensors: torch.Tensor, head_dim: int, chunk_tokens: int = 1) -> bool:
    """Whether a call on these tensors runs the Triton kernel (True) or the reference twin."""
    return pow2(head_dim) and head_dim >= 16 and pow2(chunk_tokens) and _triton_ok(*tensors)


def _pick(name: str, pool: torch.Tensor, *tensors: torch.Tensor) -> Callable:
    """The implementation of `name` for a call on this (contiguous) pool and these tensors."""
    triton = pool.is_contiguous() and uses_triton(
        pool, *tensors, head_dim=pool.shape[5], chunk_tokens=chunk_tokens(pool)
    )
    return _impl(name, triton)


@functools.cache
def _impl(name: str, triton: bool) -> Callable:
    """Cached: a long prefill makes thousands of kernel calls, and each would otherwise pay the
    module lookup on the host."""
    if triton:
        return getattr(importlib.import_module(f"kvflash.kernels.{_MODULE[name]}"), name)
    return getattr(reference, name)


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slot_table: torch.Tensor,
    n_slots: torch.Tensor,
    last_valid: torch.Tensor,
    sm_scale: float,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D] in q's dtype. Sequence b attends over slot_table[b, :n_slots[b]]
    (int32), all tokens valid except in its last listed slot, where only the first last_valid[b] are.
    rot [B, W, 2, D/2] fp32 (cos, sin), when given, rotates each listed chunk's keys: RoPE positions
    shifted per chunk (reference.shift_keys)."""
    fn = _pick("paged_decode_attention", kv_pool, q, slot_table, n_slots, last_valid)
    return fn(q, kv_pool, layer, slot_table, n_slots, last_valid, sm_scale, rot=rot)


def prefill_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    q_start: int,
    sm_scale: float,
    rot: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] at positions q_start + t -> [T, Hq, D], causal over the listed slots (int32, in
    logical order: chunk_index ascending), key j of slot i at position chunk_index[i] * C + j.
    rot [n, 2, D/2] fp32, when given, rotates each listed chunk's keys (reference.shift_keys); the
    causal mask still follows chunk_index."""
    fn = _pick("prefill_attention", kv_pool, q, slots, chunk_index)
    return fn(q, kv_pool, layer, slots, chunk_index, q_start, sm_scale, rot=rot)


def prefill_attention_batched(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    layer: int,
    pieces: torch.Tensor,
    slots: torch.Tensor,
    chunk_index: torch.Tensor,
    max_t: int,
    sm_scale: float,
) -> torch.Tensor:
    """The prefill pieces of one step, each over its own listing, in one call: q [T, Hq, D] holds
    their rows; piece i's row of pieces [P, 5] int32 is (first row, rows, first position, first
    listed, listed), its listing slots/chunk_index[first listed : first listed + listed] in logical
    order. max_t: the most rows of a piece. Keys are not rotated."""
    fn = _pick("prefill_attention_batched", kv_pool, q, pieces, slots, chunk_index)
    return fn(q, kv_pool, layer, pieces, slots, chunk_index, max_t, sm_scale)


_cache_key: list[threading.Thread] = []


def _hash_compiler() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first launch computes its key itself
        return
    triton_key()


def start_cache_key() -> None:
    """Starts computing, in the background, the hash of Triton's compiler that keys its on-disk
    cache: a process pays it once, before its first kernel loads from the cache, and it reads the
    whole compiler library. Started when a model is loaded for CUDA, it overlaps the load."""
    if not _cache_key and _have_triton():
        _cache_key.append(threading.Thread(target=_hash_compiler, daemon=True, name="kvflash-triton-key"))
        _cache_key[0].start()


def warm(kv_pool: torch.Tensor, hq: int, dtype: torch.dtype) -> None:
    """Compiles, or loads from Triton's cache, every variant of the prefill and scoring kernels that
    steps over this pool with `hq` query heads of `dtype` can launch, so that none compiles on the
    path of a turn. Nothing to do where the twins run."""
    if _pick("prefill_attention", kv_pool) is reference.prefill_attention:
        return
    variants.install()
    for thread in _cache_key:  # the key it computes is the first thing a launch needs
        thread.join()
    importlib.import_module("kvflash.kernels.triton_prefill").warm_prefill(kv_pool, hq, dtype)
    importlib.import_module("kvflash.kernels.triton_scoring").warm_lse(kv_pool, hq, dtype)


def warm_decode(kv_pool: torch.Tensor, hq: int, dtype: torch.dtype, max_batch: int, width: int) -> None:
    """Compiles, or loads from Triton's cache, every variant of the decode kernel that batches of 1 to
    `max_batch` sequences with slot tables `width` chunks wide can launch outside a CUDA graph: the
    decode rows of a mixed step are as many as run, not padded to a captured graph's size, so they
    meet launch rules no graph ran. Nothing to do where the twins run."""
    if _pick("paged_decode_attention", kv_pool) is reference.paged_decode_attention:
        return
    importlib.import_module("kvflash.kernels.triton_decode").warm_decode(kv_pool, hq, dtype, max_batch, width)


def chunk_summaries(kv_pool: torch.Tensor, slots: torch.Tensor, blocks: int) -> torch.Tensor:
    """[n, L, Hkv, blocks, D] fp32: the mean key of each of `blocks` equal runs of tokens of each
    listed (full) chunk."""
    return _pick("chunk_summaries", kv_pool, slots)(kv_pool, slots, blocks)


def chunk_lse(
    q: torch.Tensor, kv_pool: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """q [L, T, Hq, D] (every layer's queries) -> [L, T, Hq, n] fp32: log Σ exp(q·k/√D) over each
    listed (full) chunk's keys, read in place from the pool. rot [n, 2, D/2] fp32, when given, moves
    each chunk's keys (reference.shift_keys)."""
    extra = () if rot is None else (rot,)
    return _pick("chunk_lse", kv_pool, q, slots, *extra)(q, kv_pool, slots, rot)


def chunk_lse_in_place(
    q: torch.Tensor, host_kv: torch.Tensor, slots: torch.Tensor, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """`chunk_lse` for queries on the GPU over chunks in pinned host memory, run by the Triton
    kernel, which reads the keys where they are (unified addressing makes page-locked memory
    addressable from the device): only the keys cross the bus, and only once."""
    assert q.is_cuda and slots.is_cuda and host_kv.is_pinned(), "needs CUDA queries over pinned memory"
    return _impl("chunk_lse", True)(q, host_kv, slots, rot)


def write_tokens(
    kv_pool: torch.Tensor,
    layer: int,
    slot: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Stores k/v [T, Hkv, D] at position offset[t] of slot slot[t] (int32) in layer `layer`."""
    _pick("write_tokens", kv_pool, slot, offset, k, v)(kv_pool, layer, slot, offset, k, v)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] -> (RMSNorm(x + residual) * weight, x + residual): the residual add and the norm
    after it in one pass (residual None: x alone)."""
    extra = () if residual is None else (residual,)
    return _impl("rms_norm", _triton_ok(x, weight, *extra))(x, weight, eps, residual)


def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, Hq, D] and k [T, Hkv, D] at cos/sin [T, D] fp32 (Rotary.cos_sin). The Triton
    kernel turns them in place; the twin returns new tensors."""
    triton = uses_triton(q, k, cos, sin, head_dim=q.shape[-1])
    return _impl("rotary_qk", triton)(q, k, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> SiLU(gate) * up [T, I]."""
    return _impl("silu_mul", _triton_ok(gate_up))(gate_up)
