"""The restore transaction on a tiny random-weight model over a real store: a restore that fails
in any way leaves nothing behind and the prompt goes cold; the store counts only validated restores;
a save replaces only the snapshots it supersedes."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from pathlib import Path

import pytest
import torch

from kvflash.config import CACHE_ORDERS, EngineConfig, ResidencyConfig
from kvflash.engine import paged_kv
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.engine.pool import chunk_bytes
from kvflash.engine.positions import CachePositions
from kvflash.models.loader import LoadedModel
from kvflash.serve import snapshots
from kvflash.serve.job import Job
from kvflash.serve.prefix_cache import PrefixCache
from kvflash.serve.scheduler import Scheduler
from kvflash.serve.snapshots import KVSnapshots
from kvflash.serve.turn import TurnStats
from kvflash.storage import SnapshotStore, chain_hashes
from tests.tiny import tiny_config, tiny_model

CFG = tiny_config()
RES = ResidencyConfig(chunk_tokens=16, tail_chunks=1, tau=8, tau_history_div=1 << 30)
FP = "7" * 32


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, torch.device("cpu"))


@pytest.fixture
def store(tmp_path):
    with SnapshotStore(tmp_path / "store") as st:
        yield st


def engine(lm, pool_tokens: int = 512, host_bytes: int = 8 << 30) -> Engine:
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, host_bytes=host_bytes, residency=RES))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def saved(lm, snapshots: KVSnapshots, ids: list[int], label: str = "doc", budget: int | None = None) -> str:
    """Prefills ids in a new sequence and snapshots its sealed prefix; returns the snapshot id."""
    eng = engine(lm)
    kv = eng.new_sequence(budget)
    eng.prefill(kv, ids)
    try:
        return snapshots.save(kv, label)
    finally:
        kv.free()


def live_leases(store: SnapshotStore) -> int:
    return store.index.db.conn.execute("SELECT COUNT(*) FROM leases").fetchone()[0]


def damage_payloads(store: SnapshotStore, snapshot_id: str) -> None:
    """Flips a KV payload byte of every chunk of the snapshot (their summaries stay intact)."""
    for h in store.get_snapshot(snapshot_id).chunk_hashes:
        path = store.root / "chunks" / h[:2] / f"{h}.kvc"
        data = bytearray(path.read_bytes())
        data[-20] ^= 0xFF
        path.write_bytes(bytes(data))


def test_a_restore_that_fills_the_host_tier_leaves_nothing_behind(lm, store) -> None:
    """Twelve stored chunks restored eagerly into a host tier of four: HostTierFull (no ChunkError)
    must free the sequence, its host slots and its lease before the prompt goes cold."""
    snapshots = KVSnapshots(store, FP)
    ids = prompt(200, 1)
    sid = saved(lm, snapshots, ids)
    eng = engine(lm, host_bytes=4 * chunk_bytes(CFG, 16, torch.float32))
    cache = PrefixCache(eng, snapshots, lazy=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        taken = cache.take(ids + [1, 2])
    kv = taken.kv
    assert any("HostTierFull" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert len(kv.seq) == 0 and taken.source == "cold" and taken.restored_tokens == 0
    assert list(cache._made) == [id(kv)]  # the failed restore's sequence is gone
    assert live_leases(store) == 0
    assert store.get_snapshot(sid).hits == 0  # nothing was restored
    for h in [eng.host.alloc() for _ in range(4)]:  # the host tier's four slots are free again
        eng.host.release(h)
    eng.prefill(kv, ids + [1, 2])  # the cold prefill has the whole pool
    cache.close()


def test_admission_reserves_no_host_slots_for_an_eager_restore_the_host_tier_cannot_hold(lm, store) -> None:
    """The same twelve chunks: a tier of four cannot hold their restore, which would fail at once,
    so a request for them reserves nothing (else it would wait at the queue's head for slots that
    can never be free); a tier of sixteen reserves all twelve."""
    snapshots = KVSnapshots(store, FP)
    ids = prompt(200, 1)
    saved(lm, snapshots, ids)
    for slots, reserved in ((4, 0), (16, 12)):
        eng = engine(lm, host_bytes=slots * chunk_bytes(CFG, 16, torch.float32))
        cache = PrefixCache(eng, snapshots, lazy=False)
        assert cache.eager_restore_chunks(ids + [1, 2], 0) == reserved
        cache.close()
    assert eng.pool.n_free == eng.pool.n_slots


def run_one(sched: Scheduler, ids: list[int], max_tokens: int) -> tuple[list[int], TurnStats]:
    box: list = []
    done = threading.Event()

    def finished(out, stats, kv) -> None:
        box.append((out, stats))
        done.set()

    def failed(e: BaseException) -> None:
        box.append(e)
        done.set()

    sched.submit(Job(ids, max_tokens, Sampling(), lambda t: False, finished, failed))
    assert done.wait(60), "the request was never answered"
    assert not isinstance(box[0], BaseException), box[0]
    return box[0]


def test_damaged_lazy_chunks_fall_back_to_a_cold_prefill_with_no_hit(lm, store) -> None:
    """A prompt over 18 stored chunks with a budget of 8 restores lazily: the summaries are intact,
    every payload is damaged. The chunks read during the prefill fail their checks; the request
    answers as a cold one does, and the snapshot counts no hit."""
    snapshots = KVSnapshots(store, FP)
    doc = prompt(300, 2)
    ids = doc + prompt(20, 3)
    sid = saved(lm, snapshots, doc, budget=128)  # the serving budget: approximate KV
    damage_payloads(store, sid)
    cold_sched = Scheduler(engine(lm), None, frozenset(), max_batch=4, sequence_tokens=128)
    try:
        cold, _ = run_one(cold_sched, ids, 8)
    finally:
        cold_sched.close()
    sched = Scheduler(engine(lm), snapshots, frozenset(), max_batch=4, sequence_tokens=128)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, stats = run_one(sched, ids, 8)
    finally:
        sched.close()
    assert any("unusable" in str(w.message) for w in caught)
    assert out == cold
    assert stats.source == "cold" and stats.restored_tokens == 0
    assert store.get_snapshot(sid).hits == 0
    assert live_leases(store) == 0


def test_a_lazy_restore_counts_its_hit_when_its_turn_completes(lm, store) -> None:
    snapshots = KVSnapshots(store, FP)
    doc = prompt(300, 2)
    sid = saved(lm, snapshots, doc, budget=128)
    sched = Scheduler(engine(lm), snapshots, frozenset(), max_batch=4, sequence_tokens=128)
    try:
        _, stats = run_one(sched, doc + prompt(20, 3), 4)
    finally:
        sched.close()
    assert stats.source == "lazy" and stats.restored_tokens == 288
    assert store.get_snapshot(sid).hits == 1


@pytest.mark.parametrize("cache_order", CACHE_ORDERS)
def test_a_restored_document_answers_as_the_sequence_that_prefilled_it(
    lm, store, monkeypatch, cache_order: str
) -> None:
    """A document of 24 chunks prefilled over a budget of 10 and snapshotted, then a question and
    teacher-forced decode steps: after an eager restore, the logits of the sequence that prefilled
    it. Under `score` some selections lay the chunks out away from the document's order, by scores
    the restored sequence computes as the live one did."""
    reordered: list[bool] = []
    layout = CachePositions.layout

    def spy(pos: CachePositions, order: list[int], first: int, scores: list[float]) -> list[int]:
        out = layout(pos, order, first, scores)
        reordered.append(out != order)
        return out

    monkeypatch.setattr(CachePositions, "layout", spy)
    res = dataclasses.replace(RES, cache_order=cache_order)
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=res))
    snaps = KVSnapshots(store, FP, prefetch=False)
    doc, question, forced = prompt(24 * 16, 5), prompt(20, 6), prompt(24, 7)

    def ask(kv) -> torch.Tensor:
        out = [eng.prefill(kv, question)]
        step = eng.decode_step(kv)
        out += [step(tok, len(doc) + len(question) + i).reshape(-1).clone() for i, tok in enumerate(forced)]
        kv.free()
        return torch.stack(out)

    kv = eng.new_sequence(10 * 16)
    eng.prefill(kv, doc)
    snaps.save(kv, "doc")
    live = ask(kv)
    fp, hashes = snaps.lookup(doc + question, 16, approximate=True)
    assert fp == snaps.approx_fp and len(hashes) == 24
    with contextlib.ExitStack() as leases:
        kv = eng.new_sequence(10 * 16)
        snaps.restore(kv, fp, hashes, False, leases)
        torch.testing.assert_close(ask(kv), live, rtol=1e-5, atol=1e-5)
    assert any(reordered) == (cache_order == "score")


def test_a_save_replaces_only_the_snapshots_it_supersedes(lm, store) -> None:
    """Under one label: another engine's snapshot (another fingerprint) stays, approximate KV never
    replaces exact KV, exact KV replaces approximate KV, and a pinned snapshot stays (its removal
    refused) while the new one is written."""
    ids = prompt(100, 4)
    other = saved(lm, KVSnapshots(store, "8" * 32), ids)
    snapshots = KVSnapshots(store, FP)
    exact = saved(lm, snapshots, ids)
    approx = saved(lm, snapshots, ids, budget=64)
    fps = {s.id: s.fingerprint for s in store.list_snapshots()}
    assert fps == {other: "8" * 32, exact: FP, approx: snapshots.approx_fp}
    store.pin(exact)
    newer = saved(lm, snapshots, ids)
    assert {s.id for s in store.list_snapshots()} == {other, exact, newer}  # approx replaced, pin kept
    newest = saved(lm, snapshots, ids)
    assert {s.id for s in store.list_snapshots()} == {other, exact, newest}


def test_a_lookup_checks_a_span_at_a_time_and_a_save_hashes_only_new_chunks(lm, store, monkeypatch) -> None:
    """A lookup finds the longest stored prefix across several spans (a change, a missing file stop
    it where they are); a turn's save hashes only the chunks after those its restore found."""
    monkeypatch.setattr(snapshots, "LOOKUP_SPAN", 2)
    snaps = KVSnapshots(store, FP)
    doc = prompt(300, 2)
    saved(lm, snaps, doc)
    c = RES.chunk_tokens
    full = chain_hashes(FP, doc, c)
    assert len(full) == 18 and snaps.lookup(doc + [1], c, approximate=True) == (FP, full)
    changed = doc[:]
    changed[11 * c + 3] ^= 1
    assert snaps.lookup(changed, c, approximate=False) == (FP, full[:11])

    hashed: list[int] = []
    real = paged_kv.chain_hashes
    monkeypatch.setattr(paged_kv, "chain_hashes", lambda fp, t, *a: hashed.append(len(t)) or real(fp, t, *a))
    cache = PrefixCache(engine(lm), snaps)
    taken = cache.take(doc + prompt(40, 5))
    kv = taken.kv
    assert taken.restored_tokens == 288 and kv.chain == (FP, full)
    cache.engine.prefill(kv, (doc + prompt(40, 5))[len(kv.seq) :])
    staged = snaps.stage(kv)
    assert hashed == [3 * c] and staged.items[:18] == full  # the three new chunks alone were hashed
    staged.release()
    cache.close()

    (store.root / "chunks" / full[13][:2] / f"{full[13]}.kvc").unlink()
    assert snaps.lookup(doc + [1], c, approximate=False) == (FP, full[:13])


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_staged_snapshot_keeps_what_it_copied_while_its_pool_slots_are_reused(
    store, device, monkeypatch
) -> None:
    """A snapshot's resident chunks and their summaries are staged into free host-tier slots and
    host memory (on CUDA without waiting for the copies: staging returns while work queued before
    it still runs): the sequence freed and its pool slots and summaries overwritten right after
    staging, the snapshot still writes the chunks' KV and summaries as staged; a chunk that already
    has a host copy is held, not copied; and every host slot comes back once it is written. (The
    tiny model's heads are below the Triton kernels' smallest dot, so its attention runs the twins;
    the copies are what is tested.)"""
    monkeypatch.setenv("KVFLASH_KERNELS", "torch")
    dev = torch.device(device)
    lm = LoadedModel(tiny_model(CFG).to(dev), None, CFG, Path("tiny"), torch.float32, dev)
    eng = engine(lm)
    eng.host.release_many(eng.host.alloc_many(64))  # free host slots to stage into
    used = eng.host.n_used
    kv = eng.new_sequence()
    eng.prefill(kv, prompt(300, 1))
    n = kv.seq.n_sealed
    want = [kv.chunk_kv(i).cpu().clone() for i in range(n)]
    parked = kv.seq.chunks[0]
    parked.host = eng.host.page_out(parked.gpu)  # the first chunk has a host copy already
    want_summaries = kv.seq.summaries[:n].cpu().clone()
    snaps = KVSnapshots(store, FP)
    if device == "cuda":
        torch.cuda._sleep(1 << 30)  # a second or so of device work queued ahead of the copies
    staged = snaps.stage(kv)
    assert parked.host in staged.held and len(staged.held) == n and eng.host.n_used == used + n
    key = kv.seq.chunks[1].key
    assert key is not None and eng.host.find(key) in staged.held  # a new host copy serves others too
    assert len(staged.copied) == (2 if device == "cuda" else 0)  # the KV's and the summaries'
    assert not any(done.query() for done in staged.copied)  # staging did not wait for them
    slots = torch.tensor([ch.gpu for ch in kv.seq.chunks[:n]], device=dev)
    with torch.inference_mode():
        kv.seq.summaries.fill_(float("nan"))  # queued after the summaries' copy, on the same stream
    kv.free()
    eng.host.fence()  # as the pager does before a freed slot is written: after the tier's copies
    eng.pool.kv.index_fill_(0, slots, float("nan"))
    sid = snaps.put(staged, "doc")
    assert eng.host.n_used == used and not staged.held
    hashes = store.get_snapshot(sid).chunk_hashes
    got = store.read_chunks_parallel(hashes, FP, tuple(want[0].shape), want[0].dtype)
    for blob, kv_want in zip(got, want, strict=True):
        assert torch.equal(blob.kv, kv_want)
    rows = torch.empty_like(want_summaries)
    store.read_summaries(hashes, FP, rows)
    assert torch.equal(rows, want_summaries)
