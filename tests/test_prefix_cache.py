"""The prefix cache's live sequences: a prompt that shares only a prefix of one reuses that prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.models.loader import LoadedModel
from kvflash.serve.prefix_cache import PrefixCache, common_prefix
from kvflash.serve.turn import TurnStats
from tests.tiny import tiny_config, tiny_model

C = 16


def _engine(policy: str, pool_tokens: int) -> Engine:
    cfg = tiny_config()
    lm = LoadedModel(tiny_model(cfg), None, cfg, Path("tiny"), torch.float32, torch.device("cpu"))
    res = ResidencyConfig(chunk_tokens=C, tail_chunks=2, policy=policy)
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, residency=res, prefill_step_tokens=64))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turn(cache: PrefixCache, ids: list[int]) -> tuple[torch.Tensor, TurnStats]:
    stats = TurnStats()
    taken = cache.take(ids)
    stats.took(taken)
    kv = taken.kv
    logits = cache.engine.prefill(kv, ids[len(kv.seq) :])
    cache.keep(kv)
    return logits, stats


@pytest.mark.parametrize("cut", [5 * C, 5 * C + 7])
def test_a_prompt_that_diverges_from_a_live_sequence_reuses_its_whole_shared_chunks(cut: int) -> None:
    eng = _engine("full", 512)
    cache = PrefixCache(eng, None)
    first = _ids(9 * C + 5, 0)
    _turn(cache, first)
    second = first[:cut] + _ids(3 * C, 1)  # as a client resending the conversation re-encoded
    logits, stats = _turn(cache, second)
    assert stats.source == "shared" and stats.restored_tokens == (cut // C) * C
    (kv,) = cache.idle  # a cache of one sequence frees the first once the second shares its chunks
    assert kv.seq.tokens == second
    assert eng.pool.n_free == eng.pool.n_slots - len(kv.resident())  # the dropped chunks' slots are back
    cold = PrefixCache(_engine("full", 512), None)
    ref, _ = _turn(cold, second)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    cache.close()
    assert eng.pool.n_free == eng.pool.n_slots


def test_a_resent_prompt_keeps_its_whole_chunks_and_prefills_the_rest() -> None:
    cache = PrefixCache(_engine("full", 512), None)
    ids = _ids(6 * C + 3, 2)
    _turn(cache, ids)
    _, stats = _turn(cache, ids)
    assert stats.source == "shared" and stats.restored_tokens == 6 * C
    assert cache.idle[0].seq.tokens == ids


def test_sharing_part_of_an_evicting_sequence_gives_back_the_host_slots_of_the_rest() -> None:
    """A cache of one sequence: the second prompt shares the first's 4 leading chunks, then the
    first is freed; only the shared chunks' host copies stay taken."""
    eng = _engine("qk", 8 * C)
    cache = PrefixCache(eng, None)
    first = _ids(30 * C, 3)
    _turn(cache, first)
    (kv,) = cache.idle
    on_host = sum(ch.host is not None for ch in kv.seq.chunks)
    assert on_host > 10  # most chunks went to the host tier
    _, stats = _turn(cache, first[: 4 * C] + _ids(C, 4))
    assert stats.source == "shared" and stats.restored_tokens == 4 * C
    (kv,) = cache.idle
    assert eng.host.n_used == sum(ch.host is not None for ch in kv.seq.chunks) < on_host


def test_a_live_sequence_sharing_no_whole_chunk_is_not_taken() -> None:
    cache = PrefixCache(_engine("full", 512), None)
    first = _ids(4 * C, 5)
    _turn(cache, first)
    _, stats = _turn(cache, first[: C - 1] + _ids(2 * C, 6))
    assert stats.source == "cold" and stats.restored_tokens == 0


@given(
    st.lists(st.integers(0, 3), max_size=300),
    st.lists(st.integers(0, 3), max_size=300),
    st.integers(0, 300),
)
def test_common_prefix_is_the_first_difference(a: list[int], tail: list[int], keep: int) -> None:
    b = a[:keep] + tail
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == first
