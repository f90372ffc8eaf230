"""KV in a dtype of its own (`EngineConfig.kv_dtype`): every tier holds it bit for bit, a snapshot
of one KV dtype never restores under another, and 16-bit KV under fp32 compute stays close to fp32
KV, on a tiny random-weight model over a real store."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from kvflash.config import DTYPES, EngineConfig, ResidencyConfig, resolve_kv_dtype
from kvflash.engine.engine import Engine
from kvflash.models.loader import LoadedModel
from kvflash.serve.prefix_cache import PrefixCache, Taken
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage import SnapshotStore
from tests.tiny import tiny_config, tiny_model

CFG = tiny_config()
C = 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    lm = LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, CPU)
    lm.weights_id = "0" * 64  # no weight files to hash: the fingerprint takes this identity
    return lm


def engine(lm: LoadedModel, kv_dtype: str, pool_tokens: int = 1024, policy: str = "full") -> Engine:
    res = ResidencyConfig(chunk_tokens=C, tail_chunks=1, policy=policy)
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, residency=res, kv_dtype=kv_dtype))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def teacher_forced(lm: LoadedModel, kv_dtype: str, steps: int) -> torch.Tensor:
    """The logits of a 300-token prefill and `steps` teacher-forced decode steps with KV in kv_dtype."""
    ids, forced = prompt(300, seed=2), prompt(steps, seed=3)
    eng = engine(lm, kv_dtype)
    kv = eng.new_sequence()
    out = [eng.prefill(kv, ids)]
    step = eng.decode_step(kv)
    for i, tok in enumerate(forced):
        out.append(step(tok, len(ids) + i).reshape(-1).clone())
    kv.free()
    return torch.stack(out)


def assert_host_round_trip(eng: Engine, kv, n: int) -> None:
    """One of the first n chunks' pool slots, paged out to the host tier and into another slot,
    keeps its bits in both."""
    slot = next(ch.gpu for ch in kv.seq.chunks[:n] if ch.gpu is not None)
    host = eng.host.page_out(slot)
    other = eng.pool.alloc()
    eng.host.page_in(host, other)
    assert torch.equal(bits(eng.host.view(host)), bits(eng.pool.kv[slot]))
    assert torch.equal(bits(eng.pool.kv[other]), bits(eng.pool.kv[slot]))
    eng.host.release(host)
    eng.pool.release(other)


def test_auto_keeps_bf16_kv_under_fp32_compute_on_the_cpu_and_the_models_dtype_elsewhere(lm) -> None:
    cuda = torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, cuda) == torch.float32
    assert all(resolve_kv_dtype(name, torch.float32, CPU) == dt for name, dt in DTYPES.items())
    eng = Engine(lm, EngineConfig(pool_tokens=256, residency=ResidencyConfig(chunk_tokens=C)))
    assert eng.pool.kv.dtype == eng.host.dtype == eng.kv_dtype == torch.bfloat16
    fingerprints = {engine(lm, name, 256).fingerprint for name in DTYPES}
    assert len(fingerprints) == 3 and eng.fingerprint == engine(lm, "bf16", 256).fingerprint


@pytest.mark.parametrize("kv_dtype", list(DTYPES))
def test_each_kv_dtype_round_trips_bit_exact_through_pool_host_tier_and_store(
    lm, kv_dtype: str, tmp_path
) -> None:
    dt = DTYPES[kv_dtype]
    eng = engine(lm, kv_dtype, pool_tokens=32 * C, policy="qk")
    kv = eng.new_sequence(8 * C)
    eng.prefill(kv, prompt(20 * C + 5))
    assert eng.pool.kv.dtype == eng.host.dtype == dt and kv.host.n_used > 0  # chunks were paged out
    n = kv.seq.n_sealed
    before = [kv.chunk_kv(i).clone() for i in range(n)]
    assert all(t.dtype == dt for t in before)

    assert_host_round_trip(eng, kv, n)

    # disk store: the chunk header records the dtype; eager and lazy restores give the same bits
    with SnapshotStore(tmp_path / "store") as store, contextlib.ExitStack() as leases:
        snapshots = KVSnapshots(store, eng.fingerprint, prefetch=False)
        snapshots.save(kv, "doc")
        fp, hashes = snapshots.lookup(kv.seq.tokens, C, approximate=True)
        assert len(hashes) == n and store.read_chunk(hashes[0], fp).kv.dtype == dt
        for lazy in (False, True):
            dst = eng.new_sequence(8 * C)
            snapshots.restore(dst, fp, hashes, lazy, leases)
            assert all(torch.equal(bits(dst.chunk_kv(i)), bits(before[i])) for i in range(n)), lazy
            dst.free()


def turn(eng: Engine, snapshots: KVSnapshots | None, ids: list[int]) -> tuple[torch.Tensor, Taken]:
    """The logits after ids through a prefix cache over the store (the path a server takes)."""
    cache = PrefixCache(eng, snapshots)
    taken = cache.take(ids)
    kv = taken.kv
    logits = eng.prefill(kv, ids[len(kv.seq) :])
    cache.drop(kv)
    return logits, taken


def test_a_snapshot_of_another_kv_dtype_is_a_miss_and_restore_equals_cold_within_one(lm, tmp_path) -> None:
    ids = prompt(12 * C + 7, seed=1)
    with SnapshotStore(tmp_path / "store") as store:
        saver = engine(lm, "bf16")
        kv = saver.new_sequence()
        saver.prefill(kv, ids)
        KVSnapshots(store, saver.fingerprint).save(kv, "doc")
        kv.free()
        for kv_dtype in ("fp32", "fp16"):
            eng = engine(lm, kv_dtype)
            snapshots = KVSnapshots(store, eng.fingerprint, other_kv=eng.other_kv_fingerprints())
            _, stats = turn(eng, snapshots, ids)
            assert stats.source == "cold" and stats.restored_tokens == 0, kv_dtype
            assert snapshots.other_kv_counts() == {"bf16": 1}  # what `serve` warns about
        eng = engine(lm, "bf16")
        restored, stats = turn(eng, KVSnapshots(store, eng.fingerprint), ids)
        assert stats.source in ("disk", "lazy") and stats.restored_tokens == 12 * C
    cold, _ = turn(engine(lm, "bf16"), None, ids)
    torch.testing.assert_close(restored, cold, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_16_bit_kv_under_fp32_compute_stays_close_to_fp32_kv(lm, kv_dtype: str) -> None:
    """A full budget, a 300-token prefill and 32 teacher-forced decode steps: every logit stays
    within the KV dtype's unit roundoff (eps / 2: 2**-8 for bf16, 2**-11 for fp16) of the fp32-KV
    run's, relative to the largest logit magnitude, and every step picks the same token. (Measured:
    a tenth of that.)"""
    tolerance = torch.finfo(DTYPES[kv_dtype]).eps / 2
    ref, got = (teacher_forced(lm, name, 32) for name in ("fp32", kv_dtype))
    assert ((got - ref).abs().amax() / ref.abs().amax()).item() < tolerance
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("turned", [False, True])
def test_the_torch_twins_read_16_bit_kv_under_fp32_queries_as_its_fp32_values(kv_dtype, turned: bool) -> None:
    """Each twin over a 16-bit pool with fp32 queries gives, bit for bit, what it gives over that
    pool's values held in fp32: the twins compute in fp32, so the KV dtype only rounds what is stored."""
    from kvflash.kernels import reference as ref

    g = torch.Generator().manual_seed(0)
    n_slots, layers, h_kv, c, d, hq = 6, 2, 2, 8, 16, 4
    pool = torch.randn(n_slots, layers, 2, h_kv, c, d, generator=g).to(kv_dtype)
    wide = pool.float()
    rot = torch.randn(4, 2, d // 2, generator=g) if turned else None
    slots, order = torch.tensor([4, 1, 3, 0], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    q = torch.randn(5, hq, d, generator=g)
    got, want = (ref.prefill_attention(q, p, 1, slots, order, 4 * c - 5, 0.25, rot) for p in (pool, wide))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    table, n, last = slots[None], torch.tensor([4]), torch.tensor([3])
    dec = rot[None] if turned else None
    got, want = (ref.paged_decode_attention(q[:1], p, 0, table, n, last, 0.25, dec) for p in (pool, wide))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    qs = torch.randn(layers, 3, hq, d, generator=g)
    assert torch.equal(ref.chunk_lse(qs, pool, slots, rot), ref.chunk_lse(qs, wide, slots, rot))
    assert torch.equal(ref.chunk_summaries(pool, slots, 2), ref.chunk_summaries(wide, slots, 2))
    k, v = torch.randn(2, h_kv, d, generator=g), torch.randn(2, h_kv, d, generator=g)
    ref.write_tokens(pool, 1, torch.tensor([2, 5]), torch.tensor([0, 7]), k, v)
    assert torch.equal(pool[2, 1, 0, :, 0], k[0].to(kv_dtype))
    assert torch.equal(pool[5, 1, 1, :, 7], v[1].to(kv_dtype))
