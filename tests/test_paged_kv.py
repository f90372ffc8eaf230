"""PagedKV over the chunk pool: dense equality, constant memory, floors, pins and tier round trips."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.engine import scoring
from kvflash.engine.decode_staging import DECODE_FIELDS, Staged, StagingCache
from kvflash.engine.host_tier import BLOCK_SLOTS, HostTier
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import ChunkPool, chunk_bytes
from kvflash.engine.residency import required_chunks
from kvflash.kvcache import ContiguousKV
from kvflash.models.rope import Rotary, apply_rotary, inv_frequencies
from tests.tiny import tiny_config, tiny_model

CPU = torch.device("cpu")


def make_kv(cfg, n_slots: int, budget: int | None = None, step_chunks: int | None = None, **res) -> PagedKV:
    rc = ResidencyConfig(**{"chunk_tokens": 16, "tail_chunks": 2, **res})
    pool = ChunkPool(cfg, n_slots, rc.chunk_tokens, torch.float32, CPU)
    return PagedKV(pool, HostTier(pool, 1 << 26), rc, budget or n_slots, step_chunks=step_chunks)


def test_full_budget_equals_dense_reference_prefill_and_64_decode_steps() -> None:
    cfg = tiny_config()
    model = tiny_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (200,))
    dense = ContiguousKV(cfg, 300, torch.float32, CPU)
    paged = make_kv(cfg, n_slots=20)
    torch.testing.assert_close(
        model(ids, torch.arange(200), paged, all_logits=True),
        model(ids, torch.arange(200), dense, all_logits=True),
        rtol=1e-5,
        atol=1e-5,
    )
    tok = int(ids[-1])
    for i in range(64):
        step, pos = torch.tensor([tok]), torch.tensor([200 + i])
        a, b = model(step, pos, dense)[0], model(step, pos, paged)[0]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        tok = int(a.argmax())


def test_decode_scores_and_reselects_only_once_the_budget_is_nearly_full(monkeypatch) -> None:
    """While every chunk is resident with room for one more, a re-selection could change nothing: no
    decode step scores chunks. From the step the sequence fills its budget, every tau-th one does."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    kv = make_kv(cfg, n_slots=16, budget=8, tau=4, tau_history_div=1 << 30)
    scored: list[int] = []
    real = kv.scorer.exact

    def spy(*args, **kwargs) -> torch.Tensor:
        scored.append(len(kv.seq.chunks))
        return real(*args, **kwargs)

    monkeypatch.setattr(kv.scorer, "exact", spy)
    model(torch.randint(0, cfg.vocab_size, (40,)), torch.arange(40), kv)
    tok = 1
    for pos in range(40, 200):
        tok = int(model(torch.tensor([tok]), torch.tensor([pos]), kv)[0].argmax())
    assert scored and min(scored) == kv.budget  # none while 3..7 chunks filled the budget of 8
    full_steps = 200 - (kv.budget - 1) * 16  # from the step that opens the 8th chunk
    assert kv.approximate and abs(len(scored) - full_steps // 4) <= 1  # then every tau = 4 steps


def test_prefill_steps_score_only_where_the_next_step_could_evict(monkeypatch) -> None:
    """Scores serve only selections that evict, and each scoring replaces the last: with steps of at
    most 2 chunks and a budget of 10, the steps that leave 9 chunks or more score, the earlier ones
    do not, and the first evicting step selects with scores of the step before it."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    kv = make_kv(cfg, n_slots=24, budget=10, step_chunks=2)
    scored: list[int] = []
    real = kv.scorer.estimated

    def spy(*args, **kwargs) -> torch.Tensor:
        scored.append(len(kv.seq.chunks))
        return real(*args, **kwargs)

    monkeypatch.setattr(kv.scorer, "estimated", spy)
    for start in range(0, 12 * 16, 32):  # steps of two chunks: 2, 4, ..., 12 chunks
        ids = torch.randint(0, cfg.vocab_size, (32,))
        model(ids, torch.arange(start, start + 32), kv)
    assert scored == [10, 12]  # 2..8 chunks leave the next step within the budget
    assert kv.approximate  # the step to 12 chunks evicted, with the scores of the step to 10


def test_a_sequence_cut_back_to_chunks_computed_before_it_evicted_holds_exact_kv_again() -> None:
    """Steps of two chunks over a budget of 10: the step to 12 chunks evicts, so the KV from chunk 10
    on is approximate. Cut back to 11 chunks it still is; cut back to 8 it is exact again, and the
    chunk its next step seals is named (shared with other sequences, saved as exact KV)."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    rc = ResidencyConfig(chunk_tokens=16, tail_chunks=2)
    pool = ChunkPool(cfg, 24, rc.chunk_tokens, torch.float32, CPU)
    kv = PagedKV(pool, HostTier(pool, 1 << 26), rc, 10, fingerprint="tiny", step_chunks=2)
    for start in range(0, 12 * 16, 32):
        model(torch.randint(0, cfg.vocab_size, (32,)), torch.arange(start, start + 32), kv)
    assert kv.approximate and kv.exact_chunks == 10
    assert [ch.key is not None for ch in kv.seq.chunks] == [True] * 10 + [False] * 2
    kv.truncate(11)
    assert kv.approximate
    kv.truncate(8)
    assert not kv.approximate
    model(torch.randint(0, cfg.vocab_size, (16,)), torch.arange(128, 144), kv)
    assert not kv.approximate and kv.seq.chunks[8].key is not None


@pytest.mark.parametrize("policy", ["qk", "lru", "sink"])
def test_budget_below_context_keeps_pool_memory_constant(policy: str) -> None:
    cfg = tiny_config()
    model = tiny_model(cfg)
    kv = make_kv(cfg, n_slots=8, policy=policy)
    pool_bytes = kv.pool.kv.untyped_storage().nbytes()
    for lo in range(0, 384, 32):
        ids = torch.randint(0, cfg.vocab_size, (32,))
        logits = model(ids, torch.arange(lo, lo + 32), kv)
        assert torch.isfinite(logits).all()
        assert len(kv.resident()) <= 8
    assert kv.pool.kv.untyped_storage().nbytes() == pool_bytes
    assert len(kv.seq) == 384 and kv.seq.n_sealed == 24
    assert kv.host.n_used >= 24 - 8


def test_full_policy_refuses_context_larger_than_budget() -> None:
    cfg = tiny_config()
    kv = make_kv(cfg, n_slots=4, policy="full")
    model = tiny_model(cfg)
    model(torch.zeros(64, dtype=torch.long), torch.arange(64), kv)
    with pytest.raises(KVFlashError, match="policy qk, lru or sink"):
        model(torch.zeros(16, dtype=torch.long), torch.arange(64, 80), kv)


def test_a_step_plan_lives_from_begin_to_end_and_its_listing_beyond() -> None:
    """`begin` plans the step and `end` clears the plan; the selection's listing outlives it, and a
    decode step inside the resident append head (nothing due) attends over the same listing."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    kv = make_kv(cfg, n_slots=8, policy="lru")
    model(torch.randint(0, cfg.vocab_size, (20,)), torch.arange(20), kv)
    assert kv.plan is None and not kv.scout and not kv.recording
    listing = kv.listing
    assert listing.order.tolist() == [0, 1] and listing.n == 2
    kv.begin(torch.tensor([3]), torch.tensor([20]))
    plan = kv.plan
    assert plan.listing is listing and (plan.start, plan.end, plan.ids) == (20, 21, [3])
    assert plan.write_slot.tolist() == [kv.seq.chunks[1].gpu] and plan.write_offset.tolist() == [4]
    kv.end()
    assert kv.plan is None and kv.listing is listing and len(kv.seq) == 21


def test_budget_below_floor_is_refused_up_front() -> None:
    with pytest.raises(KVFlashError, match="below the floor"):
        make_kv(tiny_config(), n_slots=16, budget=4)


def test_pin_that_breaks_the_floor_is_refused() -> None:
    kv = make_kv(tiny_config(), n_slots=8)  # floor 1 + 2 + 2 = 5 -> room for 3 pinned chunks
    kv.pin_range(0, 48)
    with pytest.raises(KVFlashError, match="break the floor"):
        kv.pin_range(48, 49)
    kv.unpin_all()
    kv.pin_range(100, 101)


def _forward_random(kv: PagedKV, n: int, gen: torch.Generator, written: dict) -> None:
    """Drives one step through the KVCache interface with random K/V, recording what was written."""
    cfg = kv.pool.cfg
    start = len(kv.seq)
    pos = torch.arange(start, start + n)
    kv.begin(torch.zeros(n, dtype=torch.long), pos)
    for layer in range(cfg.n_layers):
        q = torch.randn(n, cfg.n_heads, cfg.head_dim, generator=gen)
        k = torch.randn(n, cfg.n_kv_heads, cfg.head_dim, generator=gen)
        v = torch.randn(n, cfg.n_kv_heads, cfg.head_dim, generator=gen)
        kv.attend(layer, q, k, v)
        for j, p in enumerate(pos.tolist()):
            written[(p, layer)] = (k[j].clone(), v[j].clone())
    kv.end()


def _chunk_bytes(kv: PagedKV, i: int) -> torch.Tensor:
    ch = kv.seq.chunks[i]
    return kv.pool.kv[ch.gpu] if ch.gpu is not None else kv.host.view(ch.host)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 40)),
        st.tuples(st.just("pin"), st.integers(0, 300), st.integers(1, 40)),
        st.tuples(st.just("unpin"), st.integers(0, 300), st.integers(1, 40)),
        st.tuples(st.just("unpin_all")),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=actions, policy=st.sampled_from(["qk", "lru", "sink"]), seed=st.integers(0, 2**16))
def test_pool_invariants_under_random_operations(actions, policy, seed) -> None:
    cfg = tiny_config(n_layers=2, n_kv_heads=2, head_dim=8, n_heads=4)
    kv = make_kv(cfg, n_slots=10, budget=9, policy=policy, tail_chunks=2)
    gen = torch.Generator().manual_seed(seed)
    written: dict = {}
    c = kv.cfg.chunk_tokens
    for act in actions:
        if act[0] == "step":
            n, start = act[1], len(kv.seq)
            # as Engine.step_chunks does: a step writes no more chunks than the budget leaves room for
            while (
                n > 1 and len(required_chunks(kv.seq, kv.cfg, start // c, (start + n - 1) // c)) > kv.budget
            ):
                n -= 1
            _forward_random(kv, n, gen, written)
            first = start // c
            last = (len(kv.seq) - 1) // c
            need = required_chunks(kv.seq, kv.cfg, first, last)
            assert need <= {ch.index for ch in kv.resident()}, "a sink, tail or pinned chunk was evicted"
        elif act[0] == "pin":
            try:
                kv.pin_range(act[1], act[1] + act[2])
            except KVFlashError:
                pinned = sum(ch.pinned for ch in kv.seq.chunks)
                assert kv.cfg.floor_chunks(pinned + 1) > kv.budget or pinned
        elif act[0] == "unpin":
            kv.unpin(act[1], act[1] + act[2])
        else:
            kv.unpin_all()
        gpu = [ch.gpu for ch in kv.seq.chunks if ch.gpu is not None]
        assert len(gpu) == len(set(gpu)) and len(gpu) <= kv.budget
        assert len(gpu) + kv.pool.n_free == kv.pool.n_slots, "a slot leaked"
        host = [ch.host for ch in kv.seq.chunks if ch.host is not None]
        assert len(host) == len(set(host)) and len(host) == kv.host.n_used
    for i in range(kv.seq.n_sealed):
        ch = kv.seq.chunks[i]
        assert ch.gpu is not None or ch.host is not None, f"chunk {i} was lost"
        data = _chunk_bytes(kv, i)
        for p in range(i * c, (i + 1) * c):
            for layer in range(cfg.n_layers):
                k, v = written[(p, layer)]
                assert torch.equal(data[layer, 0, :, p - i * c], k)
                assert torch.equal(data[layer, 1, :, p - i * c], v)
    kv.free()
    assert kv.pool.n_free == kv.pool.n_slots and kv.host.n_used == 0


def test_tier_round_trips_are_bit_exact() -> None:
    cfg = tiny_config()
    pool = ChunkPool(cfg, 3, 16, torch.bfloat16, CPU)
    host = HostTier(pool, 1 << 24)
    pool.kv.copy_(torch.randn(pool.kv.shape).to(torch.bfloat16))
    original = pool.kv[0].clone()
    slot = 0
    for _ in range(5):
        h = host.page_out(slot)
        pool.kv[slot].fill_(float("nan"))
        slot = (slot + 1) % 3
        host.page_in(h, slot)
        host.fence()
        host.release(h)
    assert torch.equal(pool.kv[slot].view(torch.int16), original.view(torch.int16))


def test_host_memory_first_taken_inside_a_forward_takes_page_outs_outside_one() -> None:
    """The host tier's first block is allocated by whichever thread first needs a slot, often inside
    a forward (inference mode: an engine's warm-up paging out on CUDA). A sequence parked later for
    a new request pages out outside one, into that block: it must be an ordinary tensor."""
    cfg = tiny_config()
    pool = ChunkPool(cfg, 3, 16, torch.bfloat16, CPU)
    host = HostTier(pool, 1 << 24)
    with torch.inference_mode():
        host.release(host.page_out(0))
    pool.kv[1].copy_(torch.randn(pool.kv[1].shape).to(torch.bfloat16))
    h = host.page_out(1)
    host.page_in(h, 2)
    host.fence()
    assert torch.equal(pool.kv[2].view(torch.int16), pool.kv[1].view(torch.int16))


def test_room_wanted_later_waits_for_quiet_and_keeps_nothing_waiting_meanwhile() -> None:
    """Staging room (`reserve(later=True)`) is pinned only once the quiet event is set. Meanwhile an
    allocation that finds no free slot grows the tier itself instead of waiting for the grower, and
    room a prefill wants now (`reserve`) grows at once."""
    cfg = tiny_config()
    pool = ChunkPool(cfg, 3, 16, torch.bfloat16, CPU)
    host = HostTier(pool, 4 * BLOCK_SLOTS * chunk_bytes(cfg, 16, torch.bfloat16))
    quiet = threading.Event()
    host.yield_to(quiet, 60.0)

    def grown(n: int) -> bool:
        with host._grown:
            return host._grown.wait_for(lambda: host.n_allocated == n, timeout=10)

    host.reserve(3 * BLOCK_SLOTS, later=True)
    time.sleep(0.1)
    assert host._growing and host.n_allocated == 0
    with ThreadPoolExecutor(1) as pool_thread:  # bounded: it must not wait for the yielding grower
        taken = pool_thread.submit(host.alloc_many, 2).result(timeout=10)
    assert len(taken) == 2 and host.n_allocated == BLOCK_SLOTS
    host.reserve(2 * BLOCK_SLOTS)
    assert grown(2 * BLOCK_SLOTS)
    time.sleep(0.1)
    assert host.n_allocated == 2 * BLOCK_SLOTS
    quiet.set()
    assert grown(3 * BLOCK_SLOTS)


def test_scout_scores_from_exact_keys_find_one_sharp_key_that_block_means_miss() -> None:
    """Chunk 3 leans a little towards the query in every token, chunk 7 holds one key that matches it
    hard. Attention gives chunk 7 about 50x the mass of chunk 3, but their block means rate chunk 3
    higher; a prefill step's estimate is fooled, the question's scout (exact keys, streamed from the
    host tier) is not."""
    cfg = tiny_config()
    kv = make_kv(cfg, n_slots=8, policy="qk", cache_positions=False)  # raw keys: no RoPE to undo
    h_kv, hq, d, c = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, 16
    u = torch.zeros(d)
    u[0] = 1.0
    gen = torch.Generator().manual_seed(0)

    def step(lo: int, t: int, keys: torch.Tensor, q: torch.Tensor, scout: bool = False) -> None:
        kv.begin(torch.zeros(t, dtype=torch.long), torch.arange(lo, lo + t), scout=scout)
        for layer in range(cfg.n_layers):
            kv.attend(layer, q.expand(t, hq, d), keys[:, None].expand(t, h_kv, d), torch.randn(t, h_kv, d))
        kv.end()

    q_doc = torch.randn(1, hq, d, generator=gen) * 0.1
    for i in range(20):
        keys = torch.randn(c, d, generator=gen) * 0.05
        keys[:, 0] = 0.0
        if i == 3:
            keys += 1.2 * u
        if i == 7:
            keys[5] = 8.0 * u
        step(i * c, c, keys, q_doc)
    assert kv.seq.chunks[7].host is not None and kv.seq.chunks[7].gpu is None

    q_question = (4.0 * u).expand(1, hq, d)
    step(20 * c, 2, torch.randn(2, d, generator=gen) * 0.05, q_question)  # a prefill step: estimates
    kv.selector.apply_scores(kv.seq)
    assert kv.seq.chunks[3].score > kv.seq.chunks[7].score
    step(len(kv.seq), 2, torch.randn(2, d, generator=gen) * 0.05, q_question, scout=True)
    kv.selector.apply_scores(kv.seq)
    assert kv.seq.chunks[7].score > 10 * kv.seq.chunks[3].score


@pytest.mark.parametrize("score_bytes", [1 << 30, 1], ids=["all-layers", "layer-by-layer"])
def test_prefill_scores_sum_each_layers_largest_estimated_share(monkeypatch, score_bytes: int) -> None:
    """A prefill step scores each earlier chunk by its block means: per layer, a softmax over every
    block-mean logit of every chunk (each block's log-mass counting its tokens), the largest share
    any of the step's last `score_queries` queries and heads gives the chunk, summed over layers. The
    step scores all layers at once or in batches (SCORE_BYTES); either way it is this sum."""
    monkeypatch.setattr(scoring, "SCORE_BYTES", score_bytes)
    cfg = tiny_config(n_layers=3)
    kv = make_kv(cfg, n_slots=8, policy="qk", cache_positions=False, score_queries=5)
    h_kv, hq, d, c, blocks = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, 16, kv.cfg.summary_blocks
    gen = torch.Generator().manual_seed(2)
    for i in range(6):  # six sealed chunks, the step's own queries random
        kv.begin(torch.zeros(c, dtype=torch.long), torch.arange(i * c, (i + 1) * c))
        for layer in range(cfg.n_layers):
            kv.attend(layer, torch.randn(c, hq, d, generator=gen), torch.randn(c, h_kv, d, generator=gen),
                      torch.randn(c, h_kv, d, generator=gen))  # fmt: skip
        kv.end()
    t = 9
    kv.begin(torch.zeros(t, dtype=torch.long), torch.arange(6 * c, 6 * c + t))
    want = torch.zeros(6)
    for layer in range(cfg.n_layers):
        q = torch.randn(t, hq, d, generator=gen)
        kv.attend(layer, q, torch.randn(t, h_kv, d, generator=gen), torch.randn(t, h_kv, d, generator=gen))
        means = kv.seq.summaries[:6, layer]  # [chunk, Hkv, block, D]
        qs = q[-5:].view(5, h_kv, hq // h_kv, d)
        logits = torch.einsum("thgd,nhbd->thgnb", qs, means) / d**0.5
        lse = logits.logsumexp(-1) + math.log(c // blocks)  # [t, Hkv, G, chunk]
        want += torch.softmax(lse.flatten(1, 2), -1).amax(dim=(0, 1))
    kv.end()
    kv.selector.apply_scores(kv.seq)
    torch.testing.assert_close(torch.tensor([ch.score for ch in kv.seq.chunks[:6]]), want)


@pytest.mark.parametrize("cache_positions", [True, False])
def test_resident_chunks_attend_at_positions_within_the_cache(cache_positions: bool) -> None:
    """Under eviction each resident chunk's keys rotate forward by C x the evicted chunks between it and
    the step's queries (the sink by all of them, the window by none); off, they stay absolute."""
    cfg = tiny_config()
    kv = make_kv(cfg, n_slots=8, budget=6, policy="sink", cache_positions=cache_positions)
    model = tiny_model(cfg)
    for start in range(0, 16 * 12, 16):
        model(torch.zeros(16, dtype=torch.long), torch.arange(start, start + 16), kv)
    order = kv.listing.order.tolist()
    assert order[0] == 0 and order[1:] == list(range(order[1], 12)), order
    if not cache_positions:
        assert kv.listing.rot is None
        return
    gap = order[1] - 1  # chunks 1 .. order[1] - 1 are evicted
    ang = gap * 16 * inv_frequencies(cfg)
    torch.testing.assert_close(kv.listing.rot[0], torch.stack([ang.cos(), ang.sin()]))
    torch.testing.assert_close(kv.listing.rot[1:, 0], torch.ones(len(order) - 1, cfg.head_dim // 2))
    torch.testing.assert_close(kv.listing.rot[1:, 1], torch.zeros(len(order) - 1, cfg.head_dim // 2))


@pytest.mark.parametrize("cache_positions", [True, False])
def test_chunks_are_scored_from_where_they_would_sit(cache_positions: bool) -> None:
    """Chunks 2 and 12 hold the same keys before RoPE. Under cache positions every chunk before the
    tail is scored as if it sat just before the tail, so the two score alike; at absolute positions
    their distances to the question differ, and so do their scores."""
    cfg = tiny_config()
    kv = make_kv(cfg, n_slots=8, policy="qk", cache_positions=cache_positions)
    rotary, h_kv, hq, d, c = Rotary(cfg), cfg.n_kv_heads, cfg.n_heads, cfg.head_dim, 16
    gen = torch.Generator().manual_seed(1)
    same = torch.randn(c, h_kv, d, generator=gen)

    def step(lo: int, t: int, keys: torch.Tensor, q: torch.Tensor, scout: bool = False) -> None:
        cos, sin = rotary.cos_sin(torch.arange(lo, lo + t))
        kv.begin(torch.zeros(t, dtype=torch.long), torch.arange(lo, lo + t), scout=scout)
        for layer in range(cfg.n_layers):
            k = apply_rotary(keys, cos, sin)
            kv.attend(layer, apply_rotary(q.expand(t, hq, d), cos, sin), k, torch.randn(t, h_kv, d))
        kv.end()

    for i in range(20):
        keys = same if i in (2, 12) else torch.randn(c, h_kv, d, generator=gen) * 0.3
        step(i * c, c, keys, torch.randn(1, hq, d, generator=gen))
    keys = torch.randn(2, h_kv, d, generator=gen)
    step(len(kv.seq), 2, keys, torch.randn(1, hq, d, generator=gen) * 2, scout=True)
    kv.selector.apply_scores(kv.seq)
    a, b = kv.seq.chunks[2].score, kv.seq.chunks[12].score
    assert (abs(a - b) < 1e-4 * max(a, b)) == cache_positions, (a, b)


def test_freed_decode_buffers_go_to_the_next_sequence_of_their_budget_renumbered() -> None:
    cache = StagingCache(head_dim=16, device=torch.device("cpu"), keep=2)
    a = cache.take(8)
    a.list(torch.arange(3, dtype=torch.int32), torch.zeros(3, 2, 8))
    a.stage(5, 10, 1, 2, 3, send=False)
    assert a.rotated
    written = a.table_write
    cache.give(a)
    assert cache.take(4) is not a  # another budget: new buffers
    b = cache.take(8)
    assert b is a and not b.rotated and b.fields == () and b.table_write > written
    assert cache.take(8) is not a  # handed out once
    three = [cache.take(8) for _ in range(3)]
    for s in three:
        cache.give(s)
    again = [cache.take(8) for _ in range(3)]
    assert sum(any(s is t for t in three) for s in again) == 2  # two were kept, the third is new


@pytest.mark.parametrize("rows", [1, 3, 6, 19, 32])
def test_staged_rows_start_16_byte_aligned_whatever_the_batch(rows: int) -> None:
    """A batch's decode fields (`Staged`, [F, rows]): every field's row starts on a 16-byte boundary
    for every batch size (the kernels' pointer arguments then have one alignment, which Triton
    compiles a variant for), and `send` writes the values into exactly those rows."""
    staged = Staged((DECODE_FIELDS, rows), CPU)
    assert staged.device.shape == (DECODE_FIELDS, rows)
    assert all(staged.device[f].data_ptr() % 16 == 0 for f in range(DECODE_FIELDS))
    values = np.arange(DECODE_FIELDS * rows, dtype=np.int32).reshape(DECODE_FIELDS, rows)
    staged.send(values)
    assert staged.device.tolist() == values.tolist()
    staged.send(values + 1)
    assert staged.device.tolist() == (values + 1).tolist()
