"""Shared document KV in the pool, on a tiny random-weight model: sequences whose prompts share a
chunk-aligned prefix read its sealed chunks from the same slots, each answers as it does alone, and
no reader's eviction, drop or cancellation changes what another reads or leaks a slot."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflash import kernels
from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, decode
from kvflash.engine.paged_kv import PagedKV
from kvflash.models.loader import LoadedModel
from kvflash.serve.admission import Held, HeldCache
from kvflash.serve.job import Job
from kvflash.serve.prefix_cache import PrefixCache, Taken
from kvflash.serve.scheduler import Scheduler
from kvflash.storage import chain_hashes
from tests.cuda_util import no_device_waits
from tests.tiny import tiny_config, tiny_model

C = 16
CFG = tiny_config()


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, torch.device("cpu"))


def engine(lm, policy: str = "full", pool_chunks: int = 64, host_chunks: int = 256) -> Engine:
    res = ResidencyConfig(chunk_tokens=C, tail_chunks=1, policy=policy, tau=8, tau_history_div=1 << 30)
    chunk = CFG.kv_bytes_per_token(torch.float32) * C
    cfg = EngineConfig(
        pool_tokens=pool_chunks * C, residency=res, host_bytes=host_chunks * chunk, kv_dtype="fp32"
    )
    return Engine(lm, cfg)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def answer(eng: Engine, kv: PagedKV, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Prefills what kv lacks of prompt; the logits after it and n greedy tokens."""
    logits = eng.prefill(kv, prompt[len(kv.seq) :])
    gen = Generation(n, Sampler(Sampling(), eng.lm.device))
    return logits, decode(eng.decode_step(kv), logits, len(kv.seq), gen)


def alone(lm, prompt: list[int], n: int, **kw) -> tuple[torch.Tensor, list[int]]:
    eng = engine(lm, **kw)
    kv = eng.new_sequence()
    try:
        return answer(eng, kv, prompt, n)
    finally:
        kv.free()


def take(cache: PrefixCache, prompt: list[int]) -> tuple[PagedKV, Taken]:
    taken = cache.take(prompt)
    return taken.kv, taken


def assert_all_free(eng: Engine) -> None:
    pool, host = eng.pool, eng.host
    assert pool.n_free == pool.n_slots and pool.n_shared == 0 and len(pool.index) == 0
    assert host.n_used == 0 and not host._extra and len(host._index) == 0


def test_two_sequences_over_one_prefix_share_its_slots_and_answer_as_alone(lm) -> None:
    """The second prompt over a 6-chunk document takes the document's chunks as references to the
    first's slots: the pool holds the document once plus each one's own chunks, and each answer
    (logits and greedy tokens) is the one its prompt gets alone."""
    doc = ids(6 * C + 5, 0)
    prompts = [doc + ids(9, 1), doc + ids(12, 2)]
    eng = engine(lm)
    cache = PrefixCache(eng, None, capacity=None)
    a, sa = take(cache, prompts[0])
    got_a = answer(eng, a, prompts[0], 8)
    b, sb = take(cache, prompts[1])
    assert sa.source == "cold" and sb.source == "shared" and sb.restored_tokens == 6 * C
    assert sb.shared_host_tokens == 0
    got_b = answer(eng, b, prompts[1], 8)
    for i in range(6):
        assert a.seq.chunks[i].gpu == b.seq.chunks[i].gpu and eng.pool.refs(a.seq.chunks[i].gpu) == 2
    own = len(a.seq.chunks) - 6 + len(b.seq.chunks) - 6
    assert eng.pool.n_used == 6 + own and eng.pool.n_shared == 6
    for prompt, (logits, out) in zip(prompts, (got_a, got_b), strict=True):
        ref_logits, ref_out = alone(lm, prompt, 8)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert out == ref_out
    cache.drop(a)
    cache.drop(b)
    assert_all_free(eng)


def shared_kv(eng: Engine, kv: PagedKV, n: int) -> torch.Tensor:
    return torch.stack([eng.pool.kv[ch.gpu].clone() for ch in kv.seq.chunks[:n]])


def test_parking_and_dropping_one_reader_leaves_what_the_other_reads(lm) -> None:
    """The first sequence leaves the pool for the host tier, then is freed, while the second goes on:
    the second's shared chunks keep their slots and bytes, and its answer is the one it gets alone."""
    doc = ids(5 * C + 3, 3)
    first, second = doc + ids(7, 4), doc + ids(10, 5)
    eng = engine(lm)
    cache = PrefixCache(eng, None, capacity=None)
    a, _ = take(cache, first)
    answer(eng, a, first, 4)
    b, stats = take(cache, second)
    assert stats.restored_tokens == 5 * C
    logits = eng.prefill(b, second[len(b.seq) :])
    before, slots = shared_kv(eng, b, 5), [ch.gpu for ch in b.seq.chunks[:5]]
    a.park()
    assert not a.resident() and all(eng.pool.refs(s) == 1 for s in slots)
    cache.drop(a)
    assert [ch.gpu for ch in b.seq.chunks[:5]] == slots and torch.equal(shared_kv(eng, b, 5), before)
    out = decode(eng.decode_step(b), logits, len(b.seq), Generation(8, Sampler(Sampling(), eng.lm.device)))
    assert out == alone(lm, second, 8)[1]
    cache.drop(b)
    assert_all_free(eng)


def test_a_third_reader_of_a_document_leaves_what_admission_knows_of_the_others(lm) -> None:
    """Admission's memo walks a sequence's chunks again only when they gain or lose slots, or when a
    slot starts or stops being shared: a third reader of an already shared document leaves the
    first two's entries as they were (many conversations over one document would otherwise walk
    every reader's chunks for each one admitted), while the first reader's own growth and the
    second's leaving are seen."""
    doc = ids(6 * C + 3, 13)
    eng = engine(lm)
    cache = PrefixCache(eng, None, capacity=None)
    held_by = HeldCache(eng.pool, eng.host)
    a, _ = take(cache, doc + ids(5, 14))
    answer(eng, a, doc + ids(5, 14), 2)
    b, _ = take(cache, doc + ids(6, 15))
    before = held_by(a), held_by(b)
    assert len(before[0].shared_gpu) == 6 and before[0].shared_gpu == before[1].shared_gpu
    c, _ = take(cache, doc + ids(7, 16))
    assert (held_by(a), held_by(b)) == before and held_by(a) is before[0] and held_by(b) is before[1]
    assert held_by(c) == Held.of(c) and held_by(c).shared_gpu == before[0].shared_gpu
    eng.prefill(a, ids(2 * C, 17))
    assert held_by(a) == Held.of(a) and len(held_by(a).gpu) > len(before[0].gpu)
    cache.drop(b)
    cache.drop(c)
    assert held_by(a) == Held.of(a) and not held_by(a).shared_gpu
    cache.drop(a)
    assert_all_free(eng)


def qk_run(lm, disturb: bool) -> list[torch.Tensor]:
    """Two sequences over one 20-chunk document under `qk` with a budget of 8 chunks: the second
    shares what the first holds (its exact chunks, in the pool or the host tier) and answers 12
    tokens, re-selecting as it goes. With `disturb`, the first is parked in the host tier after
    the second's prefill and freed after its sixth token."""
    doc = ids(20 * C + 4, 6)
    eng = engine(lm, "qk", pool_chunks=24)
    cache = PrefixCache(eng, None, budget_tokens=8 * C, capacity=None)
    a, _ = take(cache, doc + ids(6, 7))
    answer(eng, a, doc + ids(6, 7), 3)
    prompt = doc + ids(9, 8)
    b, stats = take(cache, prompt)
    assert stats.source == "shared" and stats.shared_host_tokens > 0  # some came from the host tier
    logits = eng.prefill(b, prompt[len(b.seq) :])
    if disturb:
        a.park()
    step = eng.decode_step(b)
    seen, tok = [logits], int(logits.argmax())
    for i in range(12):
        if disturb and i == 6:
            cache.drop(a)
        logits = step(tok, len(b.seq))
        seen.append(logits.clone())
        tok = int(logits.argmax())
    return seen


def test_under_qk_a_reader_that_evicts_or_drops_shared_chunks_changes_nothing_the_other_reads(lm) -> None:
    """The second sequence's logits, step by step, are the same whether the first stays or leaves:
    parking the first drops only its own references, and so does freeing it."""
    calm, moved = qk_run(lm, disturb=False), qk_run(lm, disturb=True)
    for x, y in zip(calm, moved, strict=True):
        assert torch.equal(x, y)


def test_pins_are_each_readers_own(lm) -> None:
    """Under `qk` with a budget of 8 chunks, the second reader of a 20-chunk document pins chunks 3-5
    of it: they stay resident for it through its answer, on the slots the first reader's copies
    paged back in or their own, while the first, which pins nothing, leaves them to its policy."""
    doc = ids(20 * C + 4, 13)
    eng = engine(lm, "qk", pool_chunks=24)
    cache = PrefixCache(eng, None, budget_tokens=8 * C, capacity=None)
    first, second = doc + ids(6, 14), doc + ids(9, 15)
    a, _ = take(cache, first)
    answer(eng, a, first, 3)
    b, stats = take(cache, second)
    assert stats.source == "shared"
    b.pin_range(3 * C, 6 * C)
    answer(eng, b, second, 10)
    assert all(b.seq.chunks[i].gpu is not None for i in (3, 4, 5))
    assert not any(ch.pinned for ch in a.seq.chunks)
    a.park()  # the first leaves the pool: the second's pinned chunks stay where they are
    assert all(b.seq.chunks[i].gpu is not None and eng.pool.refs(b.seq.chunks[i].gpu) == 1 for i in (3, 4, 5))
    cache.close()
    assert_all_free(eng)


def refs_held(seqs: list[PagedKV]) -> tuple[Counter, Counter]:
    gpu = Counter(ch.gpu for kv in seqs for ch in kv.seq.chunks if ch.gpu is not None)
    host = Counter(ch.host for kv in seqs for ch in kv.seq.chunks if ch.host is not None)
    return gpu, host


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 14), st.integers(0, 3)),
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 40)),
        st.tuples(st.just("park"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("cut"), st.integers(0, 7), st.integers(0, 12)),
        st.tuples(st.just("drop"), st.integers(0, 7), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_no_slot_is_freed_while_a_sequence_reads_it_and_none_leaks(lm, ops) -> None:
    """Random takes (sharing a random prefix of one document), growth (prefill, evicting under `qk`
    with a budget of 6 chunks), parks, cuts and drops of up to four sequences: after each, every
    pool and host slot has exactly as many references as sequences hold it, a held slot's bytes
    are the ones it was sealed with (a chunk's name, its KV up to float summation order), what
    admission's memo says each sequence holds is what it holds, and once all are dropped every
    slot is free."""
    eng = engine(lm, "qk", pool_chunks=24, host_chunks=128)
    held_by = HeldCache(eng.pool, eng.host)
    doc = ids(16 * C, 9)
    seqs: list[PagedKV] = []
    sealed: dict[tuple[str, int, str], torch.Tensor] = {}
    named: dict[str, torch.Tensor] = {}
    for op, i, n in ops:
        if op == "take":
            if len(seqs) == 4:
                continue
            kv = eng.new_sequence(6 * C)
            prompt = doc[: i * C + 1] + ids(n * 5, 10 + n)
            kv.share(prompt, chain_hashes(eng.fingerprint, prompt[: (len(prompt) - 1) // C * C], C))
            eng.prefill(kv, prompt[len(kv.seq) :])
            seqs.append(kv)
        elif not seqs:
            continue
        else:
            kv = seqs[i % len(seqs)]
            if op == "grow":
                eng.prefill(kv, doc[len(kv.seq) : len(kv.seq) + n] or ids(n, 11))
            elif op == "park":
                kv.park()
            elif op == "cut":
                kv.truncate(min(n, kv.seq.n_sealed))
            else:
                kv.free()
                seqs.remove(kv)
        gpu, host = refs_held(seqs)
        assert all(eng.pool.refs(s) == k for s, k in gpu.items())
        assert eng.pool.n_used == len(gpu) and eng.host.n_used == len(host)
        assert all(eng.host.refs(h) == k for h, k in host.items())
        assert all(held_by(kv) == Held.of(kv) for kv in seqs)
        held: set[tuple[str, int, str]] = set()
        for kv in seqs:
            for ch in kv.seq.chunks:
                if ch.key is None:
                    continue
                at = ("gpu", ch.gpu, ch.key) if ch.gpu is not None else ("host", ch.host, ch.key)
                where = eng.pool.kv[ch.gpu] if ch.gpu is not None else eng.host.view(ch.host)
                held.add(at)
                # A slot holding a named chunk keeps its bytes; two sequences that computed one chunk
                # apart (in steps of other sizes) hold the same KV up to the order of float sums.
                assert torch.equal(where, sealed.setdefault(at, where.clone()))
                torch.testing.assert_close(where, named.setdefault(ch.key, where.clone()))
        sealed = {at: t for at, t in sealed.items() if at in held}  # a freed slot may be reused
    for kv in seqs:
        kv.free()
    assert_all_free(eng)


def test_concurrent_requests_over_one_document_hold_it_once_and_a_cancelled_one_frees_its_own(lm) -> None:
    """Five requests over one 20-chunk document submitted together to a 48-chunk pool: the first
    prefills it, the others wait for that prefill and share its chunks; each reserves 22 chunks, but
    admission counts the shared ones once, so all five run together; the pool's peak holds the
    document once (not five times), the third request's client leaves after its first token, the fifth fails
    (a seed its sampler refuses, after its prefill), the others answer as they do alone, and once
    the scheduler stops every slot is free."""
    doc = ids(20 * C + 7, 12)
    prompts = [doc + ids(5 + i, 20 + i) for i in range(5)]
    refs = [alone(lm, p, 6)[1] for p in prompts[:4]]
    eng = engine(lm, pool_chunks=48)
    sched = Scheduler(eng, None, frozenset(), max_batch=5)
    eng.pool.reset_peak()
    results: dict[int, tuple] = {}
    busy: list[int] = []
    done = threading.Semaphore(0)

    def job(i: int) -> Job:
        gone = threading.Event()

        def on_token(tok: int) -> bool:
            busy.append(len(sched._running) + len(sched._filling))
            if i == 2:
                gone.set()
            return False

        def finished(out, stats, kv) -> None:
            results[i] = (out, stats)
            done.release()

        def failed(e: BaseException) -> None:
            results[i] = (e, None)
            done.release()

        sampling = Sampling(1.0, 1.0, 2**64) if i == 4 else Sampling()
        return Job(prompts[i], 6, sampling, on_token, finished, failed, gone)

    try:
        for i in range(5):
            sched.submit(job(i))
        for _ in range(5):
            assert done.acquire(timeout=120)
        assert eng.pool.peak_used < 2 * 20, eng.pool.peak_used
        assert max(busy) == 5
        for i in (0, 1, 3):
            assert results[i][0] == refs[i]
        assert [results[i][1].source for i in range(4)] == ["cold", "shared", "shared", "shared"]
        assert all(results[i][1].restored_tokens == 20 * C for i in (1, 2, 3))
        assert len(results[2][0]) < 6  # it ended at its next token
        assert isinstance(results[4][0], RuntimeError | OverflowError | ValueError), results[4]
    finally:
        sched.close()
    assert_all_free(eng)


@pytest.fixture(scope="module")
def smollm_cuda(smollm_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from kvflash.models.loader import load_model

    return load_model(smollm_path, dtype="bf16", device="cuda")


def haystack_prompts(lm, n_tokens: int) -> list[list[int]]:
    """Two questions over one generated document, as chat prompts."""
    from kvflash.eval.haystack import build_haystack
    from kvflash.serve.prompt import encode_messages

    tok = lm.tokenizer
    hs = build_haystack(n_tokens, 0.4, seed=5, count_tokens=lambda s: len(tok.encode_plain(s)))
    doc = {"role": "system", "content": hs.document}
    return [
        encode_messages(tok, [doc, {"role": "user", "content": q}]) for q in (hs.question, "Summarise it.")
    ]


def cuda_engine(lm) -> Engine:
    return Engine(lm, EngineConfig(pool_tokens=16384, residency=ResidencyConfig()))


def cuda_shared_run(lm, budget: int | None, disturb: bool) -> list[int]:
    """The second prompt's 24 greedy tokens over the chunks it shares with the first (parked in the
    host tier first under a budget, so that it shares host copies, whose summaries are computed
    from copies staged to the GPU). With `disturb` the two decode in one batch for 12 steps, then
    the first is freed; else the second decodes alone and the first stays."""
    first, second = haystack_prompts(lm, 3000)
    eng = cuda_engine(lm)
    cache = PrefixCache(eng, None, budget_tokens=budget, capacity=None)
    a, _ = take(cache, first)
    la = eng.prefill(a, first)
    if budget is not None:
        a.park()
    b, stats = take(cache, second)
    assert stats.source == "shared" and stats.restored_tokens >= (2048 if budget is None else 256)
    assert stats.shared_host_tokens == (0 if budget is None else stats.restored_tokens)
    lb = eng.prefill(b, second[len(b.seq) :])
    assert b.uses_triton == eng.replays(b) == (lm.device.type == "cuda")
    toks, out = [int(la.argmax()), int(lb.argmax())], []
    for step in range(24):
        if disturb and step == 12:
            cache.drop(a)
        together = disturb and step < 12
        logits = eng.decode_batch([a, b] if together else [b], toks if together else toks[1:])
        out.append(toks[1])
        toks = [int(row.argmax()) for row in logits] if together else [toks[0], int(logits[0].argmax())]
    cache.close()
    assert_all_free(eng)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 1024])
def test_on_cuda_a_shared_document_reads_the_same_batched_and_after_its_lender_leaves(
    smollm_cuda, budget
) -> None:
    """SmolLM2 on the Triton kernels and CUDA graphs, over a 3,000-token document: the second
    prompt's greedy tokens are the same decoded alone beside the first as in one batch with it
    and after it has been freed; with the whole document in its budget, they are also the ones it
    gets on an engine of its own."""
    lm = smollm_cuda
    calm = cuda_shared_run(lm, budget, disturb=False)
    assert cuda_shared_run(lm, budget, disturb=True) == calm
    if budget is None:
        second = haystack_prompts(lm, 3000)[1]
        eng = cuda_engine(lm)
        kv = eng.new_sequence()
        logits = eng.prefill(kv, second)
        gen = Generation(24, Sampler(Sampling(), lm.device))
        assert decode(eng.decode_step(kv), logits, len(kv.seq), gen) == calm
        kv.free()


def shared_twice(
    eng: Engine, doc: list[int], quiet: Callable[[], AbstractContextManager]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sequences take doc's chunks from a sequence that prefilled it: the first while it holds
    them in the pool, the second once it is parked in the host tier; each `share` runs under
    quiet(). The summaries of the lender and of the two takers."""
    lender = eng.new_sequence()
    eng.prefill(lender, doc)
    n = lender.seq.n_sealed
    keys = lender.chain_hashes(lender.fingerprint, n)
    out = [lender.seq.summaries[:n].clone()]
    for parked in (False, True):
        if parked:
            lender.park()
        kv = eng.new_sequence()
        with quiet():
            assert kv.share(doc, keys) == n * eng.cfg.residency.chunk_tokens
        assert all((ch.gpu is None) == parked for ch in kv.seq.chunks[:n])
        out.append(kv.seq.summaries[:n].clone())
        kv.free()  # else its references keep the chunks in the pool
    return out[0], out[1], out[2]


def test_a_shared_chunks_summaries_are_its_lenders_from_the_pool_and_from_the_host_tier(lm) -> None:
    """A sequence that shares chunks with no lender to copy their summaries from computes them again
    from the keys, in place in the pool or from host copies staged to the device: the same either
    way, and the lender's."""
    lender, from_pool, from_host = shared_twice(engine(lm), ids(6 * C + 5, 9), contextlib.nullcontext)
    assert torch.equal(from_pool, lender) and torch.equal(from_host, lender)


def test_a_sharer_copies_the_summaries_of_a_sequence_holding_the_same_exact_chunks(lm, monkeypatch) -> None:
    """Taking a document's chunks through the prefix cache copies their summaries from the sequence
    that prefilled it (no chunk's keys are read again): the lender's, and what reading the keys
    gives. A lender's summaries are lent only for chunks it holds as exact KV under the same names:
    not under another fingerprint, not past its chain, not past the chunks it computed before it
    first evicted."""
    doc = ids(6 * C + 5, 21)
    eng = engine(lm)
    cache = PrefixCache(eng, None, capacity=None)
    a, _ = take(cache, doc + ids(4, 22))
    answer(eng, a, doc + ids(4, 22), 2)
    computed = a.pager.summaries(a.seq.chunks[:6], eng.cfg.residency.summary_blocks)
    with monkeypatch.context() as m:
        m.setattr(kernels, "chunk_summaries", lambda *_: pytest.fail("a lent chunk's keys were read"))
        b, taken = take(cache, doc + ids(7, 23))
    assert taken.source == "shared" and taken.restored_tokens == 6 * C
    lent = b.seq.summaries[:6]
    assert torch.equal(lent, a.seq.summaries[:6]) and torch.equal(lent, computed)
    keys = a.chain_hashes(a.fingerprint, 6)
    assert a.summaries_of(a.fingerprint, keys) is not None and a.summaries_of("other", keys) is None
    assert a.summaries_of(a.fingerprint, keys + ["not-its-own"]) is None
    cache.drop(a)
    cache.drop(b)

    qk = engine(lm, "qk", pool_chunks=24)
    evicting = qk.new_sequence(6 * C)
    qk.prefill(evicting, ids(14 * C, 24))
    first = evicting.exact_chunks
    assert first is not None and 0 < first < evicting.seq.n_sealed
    names = evicting.chain_hashes(qk.fingerprint, evicting.seq.n_sealed)
    assert evicting.summaries_of(qk.fingerprint, names[:first]) is not None
    assert evicting.summaries_of(qk.fingerprint, names[: first + 1]) is None
    evicting.free()


@pytest.mark.gpu
def test_on_cuda_sharing_a_documents_chunks_waits_for_no_step_before_it(smollm_cuda) -> None:
    """A request that shares a document's chunks (`share`) queues their summaries behind the steps
    already launched: torch's sync debug mode raises at any wait for the stream (a list index into
    a device tensor, and a blocking copy of each host copy, were two). Pool and host copies give
    the same summaries."""
    doc = haystack_prompts(smollm_cuda, 3000)[0]
    lender, from_pool, from_host = shared_twice(cuda_engine(smollm_cuda), doc, no_device_waits)
    assert torch.equal(from_pool, from_host)
    torch.testing.assert_close(from_pool, lender, rtol=1e-3, atol=1e-3)
