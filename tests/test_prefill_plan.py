"""How a prefill step is planned: its size, the chunks it pages, and the hysteresis of its selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import PoolFull
from kvflash.engine.residency import required_chunks, select_resident
from kvflash.engine.sequence import Sequence
from kvflash.models.loader import LoadedModel
from tests.test_paged_kv import _forward_random, make_kv
from tests.tiny import tiny_config, tiny_model

CPU = torch.device("cpu")


def test_a_step_pages_in_exactly_the_chunks_its_selection_names() -> None:
    cfg = tiny_config()
    kv = make_kv(cfg, n_slots=20, budget=12)  # floor 1 + 2 + 2 = 5
    gen, written = torch.Generator().manual_seed(0), {}
    for _ in range(10):
        _forward_random(kv, 32, gen, written)  # 20 chunks, 12 resident at most
    scores = torch.rand(len(kv.seq.chunks), generator=gen).tolist()
    kv.selector.scores = None  # the test's scores stand instead of the last step's
    for ch, s in zip(kv.seq.chunks, scores, strict=True):
        ch.score = s
    start = len(kv.seq)
    first, last = start // 16, (start + 31) // 16
    kv.seq.ensure_chunks(start + 32)
    selection = select_resident(kv.seq, kv.cfg, kv.budget, first, last, True, kv.cfg.keep_margin)
    before = {ch.index for ch in kv.resident()}
    on_host = {ch.index for ch in kv.seq.chunks if ch.host is not None}
    moved = dict(kv.moved)

    _forward_random(kv, 32, gen, written)

    after = {ch.index for ch in kv.resident()}
    assert after == selection
    paged_in = (after - before) & on_host
    assert paged_in, "the scores must bring some chunk in for this test to say anything"
    assert kv.moved["host_to_gpu"] - moved["host_to_gpu"] == len(paged_in) * kv.chunk_nbytes
    left = {i for i in before - after if i not in on_host}
    assert kv.moved["gpu_to_host"] - moved["gpu_to_host"] == len(left) * kv.chunk_nbytes
    for i in paged_in:  # the bytes that came in are the chunk's own
        ch = kv.seq.chunks[i]
        assert torch.equal(kv.pool.kv[ch.gpu], kv.host.view(ch.host))
        for layer in range(cfg.n_layers):
            k, v = written[(i * 16, layer)]
            assert torch.equal(kv.pool.kv[ch.gpu, layer, 0, :, 0], k)
            assert torch.equal(kv.pool.kv[ch.gpu, layer, 1, :, 0], v)


@settings(max_examples=200, deadline=None)
@given(
    scores=st.lists(st.floats(0, 10), min_size=8, max_size=40),
    resident=st.lists(st.booleans(), min_size=40, max_size=40),
    budget=st.integers(6, 20),
    margin=st.floats(0, 3),
)
def test_hysteresis_never_keeps_out_a_chunk_that_beats_a_kept_one_by_the_margin(
    scores, resident, budget, margin
) -> None:
    cfg = ResidencyConfig(chunk_tokens=4, tail_chunks=2, keep_margin=margin)
    seq = Sequence(4)
    seq.ensure_chunks(4 * (len(scores) + 1))
    for ch, s, r in zip(seq.chunks, scores, resident, strict=False):
        ch.sealed, ch.score, ch.gpu = True, s, (ch.index if r else None)
    first = last = len(scores)
    want = select_resident(seq, cfg, budget, first, last, True, margin)
    required = required_chunks(seq, cfg, first, last)
    kept = [seq.chunks[i] for i in want - required]
    out = [ch for ch in seq.chunks[:first] if ch.index not in want]
    assert len(want) == min(budget, first + 1)
    for x in out:
        for y in kept:
            factor = 1 + margin if y.gpu is not None else 1
            assert x.score <= y.score * factor, f"{x.index} beats kept {y.index}"


def test_without_a_margin_a_step_selects_the_best_scores() -> None:
    cfg = ResidencyConfig(chunk_tokens=4, tail_chunks=1, keep_margin=0.0)
    seq = Sequence(4)
    seq.ensure_chunks(4 * 11)
    for ch in seq.chunks[:10]:
        ch.sealed, ch.score, ch.gpu = True, float(ch.index % 5), ch.index if ch.index < 5 else None
    want = select_resident(seq, cfg, 6, 10, 10, True, 0.0)
    assert want == {0, 9, 10} | {4, 8, 3}  # sink, tail, append head, then the scores 4, 3, 3 (index)


def _engine(pool_tokens: int, step_tokens: int | None = None) -> Engine:
    cfg = tiny_config()
    lm = LoadedModel(tiny_model(cfg), None, cfg, Path("tiny"), torch.float32, CPU)
    res = ResidencyConfig(chunk_tokens=16, tail_chunks=2)
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, residency=res, prefill_step_tokens=step_tokens))


def test_steps_take_the_room_the_pool_has() -> None:
    eng = _engine(pool_tokens=16 * 40, step_tokens=16 * 64)
    kv = eng.new_sequence()
    assert eng.step_chunks(kv, 16 * 40) == 64  # the prompt fits: steps as large as allowed
    room = kv.budget - kv.cfg.floor_chunks() + 1  # 36 chunks above the floor, one selected
    assert eng.step_chunks(kv, 16 * 41) == room // 2 + 1  # it evicts: half the room selects
    kv.pin_range(0, 16 * 4)
    assert eng.step_chunks(kv, 16 * 41) == (room - 4) // 2 + 1
    assert _engine(pool_tokens=16 * 40).step_tokens == 512  # on the CPU by default


def test_prefill_over_the_pool_equals_its_steps_one_at_a_time() -> None:
    """Larger steps change where a step ends, not what a step computes: under `full` (every key
    resident) the logits after a prompt do not depend on the step size."""
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    full = ResidencyConfig(chunk_tokens=16, tail_chunks=2, policy="full")
    cfg = tiny_config()
    lm = LoadedModel(tiny_model(cfg), None, cfg, Path("tiny"), torch.float32, CPU)
    out = []
    for step in (16, 64, 1024):
        eng = Engine(lm, EngineConfig(pool_tokens=512, residency=full, prefill_step_tokens=step))
        out.append(eng.prefill(eng.new_sequence(), ids))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], out[2], rtol=1e-5, atol=1e-5)


def test_expect_pins_ahead_the_host_memory_a_long_prompt_pages_out() -> None:
    eng = _engine(pool_tokens=8 * 16)
    eng.expect(8 * 16)  # fits the pool: nothing leaves it
    assert eng.host._n_slots == 0
    eng.expect(200 * 16)
    with eng.host._grown:
        eng.host._grown.wait_for(lambda: not eng.host._growing, timeout=60)
    assert 192 <= eng.host._n_slots <= 256  # the chunks beyond the pool, in whole blocks of 64


def _qk_engine(pool_chunks: int, step_tokens: int, **res) -> Engine:
    cfg = tiny_config()
    lm = LoadedModel(tiny_model(cfg), None, cfg, Path("tiny"), torch.float32, CPU)
    rc = ResidencyConfig(**{"chunk_tokens": 16, "tail_chunks": 1, "policy": "qk", **res})
    return Engine(
        lm, EngineConfig(pool_tokens=16 * pool_chunks, residency=rc, prefill_step_tokens=step_tokens)
    )


def _listings(kv: PagedKV) -> list[tuple[bool, int, list[int]]]:
    """(scout, tokens, chunks listed) of each step `kv` begins from here on."""
    seen, begin = [], kv._begin

    def recording(ids, start, t, send=True, scout=False):
        begin(ids, start, t, send, scout)
        seen.append((scout, t, kv.listing.order.tolist()))

    kv._begin = recording
    return seen


def test_a_prompt_past_its_budget_only_in_its_last_piece_is_scouted() -> None:
    """12 chunks over a budget of 10, in pieces of 3 chunks: the budget is passed by the last piece
    alone, whose question still selects what it attends to from its own scouts' scores."""
    eng = _qk_engine(pool_chunks=32, step_tokens=48, tail_chunks=4)
    kv = eng.new_sequence(16 * 10)
    steps = _listings(kv)
    eng.prefill(kv, torch.randint(0, 256, (189,), generator=torch.Generator().manual_seed(2)).tolist())
    assert [s for s, _, _ in steps] == [False] * 3 + [True] * kv.cfg.scout_rounds + [False]
    assert kv.approximate and len(steps[-1][2]) == 10


@pytest.mark.parametrize("last_piece", [1, 2])
def test_the_question_attends_to_what_its_scouts_chose_whatever_its_length(last_piece: int) -> None:
    """A final piece of one token (a prompt ending one token past a piece) selects with its scouts'
    scores as a longer one does, not on the first scout's floor alone (a re-selection not yet due
    in tokens: tau far off)."""
    eng = _qk_engine(pool_chunks=32, step_tokens=64, tau=1000, tau_history_div=1 << 30)
    kv = eng.new_sequence(16 * 10)
    steps = _listings(kv)
    eng.prefill(
        kv, torch.randint(0, 256, (320 + last_piece,), generator=torch.Generator().manual_seed(5)).tolist()
    )
    first_scout, *later = steps[-kv.cfg.scout_rounds - 1 :]
    assert first_scout[0] and len(first_scout[2]) == 3  # the floor: sink, tail, append head
    assert all(t == last_piece and len(order) == 10 for _, t, order in later), later


def test_a_selection_that_fails_for_room_lists_no_slot_the_sequence_does_not_hold() -> None:
    """A decode re-selection pages its losers out, then finds the pool full. The sequence keeps no
    listing of the slots it gave up (another sequence takes them), and its step run again selects
    afresh, listing only slots it holds."""
    eng = _qk_engine(pool_chunks=14, step_tokens=48, tau=24, tau_history_div=1 << 30)
    a = eng.new_sequence(16 * 8)
    eng.prefill(a, torch.randint(0, 256, (192,), generator=torch.Generator().manual_seed(1)).tolist())
    a.park()  # all on the host: the next step selects afresh
    k = len(a.seq) // 16  # the last whole chunk of the prompt is k - 1
    for _ in range(24):
        eng.decode_batch([a], [3])
    b = eng.new_sequence(16 * 8)
    eng.prefill(
        b, torch.randint(0, 256, (16 * eng.pool.n_free,), generator=torch.Generator().manual_seed(9)).tolist()
    )
    n = len(a.seq) // 16
    a.selector.scores = torch.tensor([0.0 if i == k - 1 else 1.0 for i in range(n)])  # chunk k-1 loses
    given_up = a.seq.chunks[k - 1].gpu
    with pytest.raises(PoolFull):
        eng.decode_batch([a], [3])
    assert a.listing is None and a.seq.chunks[k - 1].gpu is None
    b.free()
    c = eng.new_sequence(16 * 14)  # writes its own KV into every free slot, chunk k-1's among them
    eng.prefill(
        c, torch.randint(0, 256, (16 * eng.pool.n_free,), generator=torch.Generator().manual_seed(3)).tolist()
    )
    assert given_up in {ch.gpu for ch in c.seq.chunks}
    c.park()  # room for a's step again
    eng.decode_batch([a], [3])
    held = {ch.index: ch.gpu for ch in a.seq.chunks if ch.gpu is not None}
    for i, slot in zip(a.listing.order.tolist(), a.listing.slots.tolist(), strict=True):
        assert held.get(i) == slot  # each listed slot is the listed chunk's own
        if (h := a.seq.chunks[i].host) is not None:
            assert torch.equal(eng.pool.kv[slot], a.host.view(h))
