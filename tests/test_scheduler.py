"""Batched decode and the scheduler, on a tiny random-weight model: a sequence decoded beside others
computes what it computes alone, and the scheduler's answers are the ones each request gets alone."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from kvflash import KVFlashError
from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, decode
from kvflash.engine.pool import chunk_bytes
from kvflash.engine.sequence import UNKNOWN
from kvflash.models.loader import LoadedModel
from kvflash.serve import prefix_cache as prefix_cache_module
from kvflash.serve import scheduler as scheduler_module
from kvflash.serve.admission import Held, HeldCache, Holdings, Room
from kvflash.serve.job import Job
from kvflash.serve.prefix_cache import common_prefix
from kvflash.serve.scheduler import Cancelled, Scheduler, SchedulerDown, StepTime, TimedOut
from kvflash.serve.snapshots import KVSnapshots
from kvflash.serve.turn import TurnStats, answer
from kvflash.storage import SnapshotStore, chain_hashes
from tests.tiny import tiny_config, tiny_model

CFG = tiny_config()
RES = ResidencyConfig(chunk_tokens=16, tail_chunks=1, tau=8, tau_history_div=1 << 30)


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, torch.device("cpu"))


def engine(lm, pool_tokens: int = 512) -> Engine:
    """fp32 KV: batched and lone rows differ by fp32 rounding, which 16-bit KV would round apart."""
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, residency=RES, kv_dtype="fp32"))


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_sequence_decoded_beside_others_computes_what_it_computes_alone(lm) -> None:
    """Three sequences of different lengths, two of them beyond their budget (evicting, turned keys,
    re-selecting every 8 tokens), teacher-forced for 24 steps: batched logits equal each one's own."""
    batched_against_alone(lm)


BATCH_STEPS = 24


def batched_against_alone(lm: LoadedModel) -> None:
    """Three sequences decoded BATCH_STEPS steps together and each alone, to the same logits."""
    lengths = [40, 150, 230]
    runs = []
    for batched in (False, True):
        eng = engine(lm)
        seqs = [eng.new_sequence(96) for _ in lengths]
        firsts = [eng.prefill(kv, prompt(n, i)) for i, (kv, n) in enumerate(zip(seqs, lengths, strict=True))]
        tokens = [int(f.argmax()) for f in firsts]
        steps = []
        for t in range(BATCH_STEPS):
            if batched:
                logits = eng.decode_batch(seqs, tokens)
            else:
                pairs = zip(seqs, tokens, strict=True)
                logits = torch.stack([eng.decode_batch([kv], [tok])[0] for kv, tok in pairs])
            steps.append(logits)
            tokens = [(7 * t + 3 * i) % CFG.vocab_size for i in range(len(seqs))]
        runs.append(torch.stack(steps))
        assert any(kv.approximate for kv in seqs)  # some of them evicted: the hard case ran
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)


def test_a_step_of_tokens_left_on_the_device_computes_what_their_ids_compute(lm) -> None:
    """`decode_batch` given the last step's argmax as a tensor (the scheduler's `Ahead`) computes
    what the same ids from the host compute; each sequence holds `UNKNOWN` until it is `settle`d,
    and names a chunk such a step completed then, as the host ids' run names it."""
    lengths, runs = (40, 70), []
    for on_device in (False, True):
        eng = engine(lm)
        seqs = [eng.new_sequence(256) for _ in lengths]
        pairs = zip(seqs, lengths, strict=True)
        logits = torch.stack([eng.prefill(kv, prompt(n, i)) for i, (kv, n) in enumerate(pairs)])
        steps = []
        for _ in range(20):
            top = logits.argmax(-1)
            logits = eng.decode_batch(seqs, top if on_device else top.tolist())
            if on_device:
                assert all(kv.seq.tokens[-1] == UNKNOWN for kv in seqs)
                for kv, tok in zip(seqs, top.tolist(), strict=True):
                    kv.settle(tok)
            steps.append(logits.clone())
        names = [[ch.key for ch in kv.seq.chunks if ch.sealed] for kv in seqs]
        runs.append((torch.stack(steps), [kv.seq.tokens for kv in seqs], names))
    (host, host_ids, host_names), (device, device_ids, device_names) = runs
    assert torch.equal(host, device) and host_ids == device_ids and device_names == host_names
    # chunks 2 (tokens 32-47) and 4 (64-79) were completed by decode steps, and are named
    assert [len(n) for n in device_names] == [3, 5] and None not in device_names[0] + device_names[1]


def run_jobs(sched: Scheduler, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results: list[list[int] | BaseException | None] = [None] * len(prompts)
    done = threading.Semaphore(0)

    def job(i: int) -> Job:
        def finished(out, stats, kv) -> None:
            results[i] = out
            done.release()

        def failed(e: BaseException) -> None:
            results[i] = e
            done.release()

        return Job(prompts[i], max_tokens, Sampling(), lambda tok: False, finished, failed)

    for i in range(len(prompts)):
        sched.submit(job(i))
    for _ in prompts:
        assert done.acquire(timeout=120)
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


def test_the_scheduler_answers_each_request_as_it_is_answered_alone(lm) -> None:
    prompts = [prompt(n, 10 + n) for n in (30, 70, 120, 45, 200)]
    alone = []
    eng = engine(lm)
    for ids in prompts:
        kv = eng.new_sequence(128)
        alone.append(answer(eng, kv, ids, 12, Sampling(), frozenset(), TurnStats(), 0.0))
        kv.free()
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=4, sequence_tokens=128)
    try:
        got = run_jobs(sched, prompts, 12)
        assert sched.batched > sched.steps, "no step decoded more than one request"
    finally:
        sched.close()
    assert got == alone
    assert sched.engine.pool.n_free == sched.engine.pool.n_slots  # close freed every sequence


def test_a_prefill_step_reads_its_pieces_first_tokens_where_it_counts_its_wait(lm) -> None:
    """A step of prefill pieces reads back its pieces' greedy first tokens at once, with its decode
    tokens, inside what it reports as its wait for the device (`StepTime.waited`): each request
    that ends its prompt there is handed its first token as read, not left to read its own row."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=4, sequence_tokens=128)
    handed: list[tuple[int | None, int]] = []
    filled = sched._filled

    def spy(job, piece, logits, argmax=None) -> None:
        if piece.final:
            handed.append((argmax, int(logits.argmax())))
        filled(job, piece, logits, argmax)

    steps: list[StepTime] = []
    sched.on_step = steps.append
    sched._filled = spy
    try:
        run_jobs(sched, [prompt(30, 1), prompt(40, 2), prompt(70, 3)], 2)
    finally:
        sched.close()
    assert len(handed) == 3 and all(read == own for read, own in handed), handed  # each its own row's
    filling = [s for s in steps if s.kind == "prefill"]
    assert filling and all(0 < s.waited <= s.seconds for s in filling), filling


def test_running_requests_decode_between_the_pieces_of_a_long_prefill(lm) -> None:
    """A request decoding when a long prompt arrives finishes before that prompt's first token: the
    long prefill goes one 32-token piece per round (8 of them), the short answer one token a round."""
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=RES, prefill_step_tokens=32))
    sched = Scheduler(eng, None, frozenset(), max_batch=2)
    events: list[str] = []
    started, submitted, finished = threading.Event(), threading.Event(), threading.Event()

    def short_token(tok: int) -> bool:
        if not started.is_set():  # hold the scheduler until the long request is queued
            started.set()
            assert submitted.wait(30)
        return False

    def long_token(tok: int) -> bool:
        events.append("long: token")
        return False

    def done(name: str):
        def on_done(out, stats, kv) -> None:
            events.append(f"{name}: done")
            if name == "long":
                finished.set()

        return on_done

    try:
        sched.submit(Job(prompt(20, 1), 6, Sampling(), short_token, done("short"), events.append))
        assert started.wait(30)
        sched.submit(Job(prompt(250, 2), 2, Sampling(), long_token, done("long"), events.append))
        submitted.set()
        assert finished.wait(60)
    finally:
        sched.close()
    assert events[:2] == ["short: done", "long: token"], events


def test_a_conversation_continued_takes_its_live_sequence(lm) -> None:
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=2)
    try:
        first = prompt(50, 1)
        (out,) = run_jobs(sched, [first], 6)
        kept = sched.cache.latest
        run_jobs(sched, [first + out + [5, 6, 7]], 4)
        assert sched.cache.latest is kept and len(kept.seq) >= len(first) + len(out) + 3
    finally:
        sched.close()


def test_a_request_whose_consumer_fails_leaves_the_others_and_the_scheduler_running(lm) -> None:
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=2)
    errors: list[BaseException] = []
    failed = threading.Event()

    seen: list[int] = []

    def broken(tok: int) -> bool:  # fails at a decode step, not at the prefill's token
        seen.append(tok)
        if len(seen) == 3:
            raise RuntimeError("the client's queue is gone")
        return False

    def on_error(e: BaseException) -> None:
        errors.append(e)
        failed.set()

    try:
        sched.submit(Job(prompt(40, 3), 8, Sampling(), broken, lambda *a: None, on_error))
        (out,) = run_jobs(sched, [prompt(60, 4)], 8)
        assert failed.wait(60) and "queue is gone" in str(errors[0])
        assert len(out) == 8 and run_jobs(sched, [prompt(30, 5)], 3)[0]  # still serving
        assert len(sched.cache._made) == 2  # the failed request's sequence was freed
    finally:
        sched.close()


def test_a_sequence_budget_below_the_floor_is_refused(lm) -> None:
    with pytest.raises(KVFlashError, match="--sequence-tokens"):
        Scheduler(engine(lm, pool_tokens=256), None, frozenset(), sequence_tokens=32)


def outcome(i: int, results: dict, done: threading.Semaphore, **kw) -> dict:
    """Callbacks that put request i's answer, or its error, in results."""

    def finished(out, stats, kv) -> None:
        results[i] = (out, stats)
        done.release()

    def failed(e: BaseException) -> None:
        results[i] = e
        done.release()

    return {"on_done": finished, "on_error": failed, **kw}


def test_a_request_whose_sampler_cannot_start_fails_alone(lm) -> None:
    """A seed outside int64 makes the sampler raise after the prefill: that request fails with the
    error, the one decoding beside it answers as it does alone, and the scheduler goes on serving."""
    ids = prompt(60, 4)
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=2)
    try:
        (alone,) = run_jobs(sched, [ids], 8)
        results, done = {}, threading.Semaphore(0)
        sched.submit(Job(ids, 8, Sampling(), lambda t: False, **outcome(0, results, done)))
        sched.submit(
            Job(prompt(40, 3), 8, Sampling(1.0, 1.0, 2**64), lambda t: False, **outcome(1, results, done))
        )
        assert done.acquire(timeout=30) and done.acquire(timeout=30), "a request was never answered"
        assert results[0][0] == alone
        assert isinstance(results[1], RuntimeError | OverflowError | ValueError), results[1]
        assert run_jobs(sched, [prompt(30, 5)], 3)[0]
        assert len(sched.cache._made) == len(sched.cache.idle)  # the failed request's sequence was freed
    finally:
        sched.close()
    assert sched.engine.pool.n_free == sched.engine.pool.n_slots


def test_a_request_whose_room_cannot_be_made_fails_alone(lm) -> None:
    """Making room for a request (parking or freeing idle sequences) raises: that request fails with
    the error, and the scheduler goes on serving the next one."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=2)
    reclaim = sched.cache.reclaim

    def broken(*args, **kwargs) -> None:
        sched.cache.reclaim = reclaim
        raise RuntimeError("the host tier could not take a parked chunk")

    try:
        run_jobs(sched, [prompt(60, 4)], 2)  # an idle sequence to make room from
        sched.cache.reclaim = broken
        results, done = {}, threading.Semaphore(0)
        sched.submit(Job(prompt(50, 6), 4, Sampling(), lambda t: False, **outcome(0, results, done)))
        assert done.acquire(timeout=30), "the request was never answered"
        assert isinstance(results[0], RuntimeError) and "parked chunk" in str(results[0])
        assert sched.healthy and run_jobs(sched, [prompt(30, 5)], 3)[0]
    finally:
        sched.close()
    assert sched.engine.pool.n_free == sched.engine.pool.n_slots


def test_a_request_that_fails_inside_a_batched_forward_fails_alone(lm) -> None:
    """Under policy `full` an answer that grows past its budget (256 tokens here) raises inside the
    batched forward; the request decoding beside it answers as it does alone."""
    res = ResidencyConfig(chunk_tokens=16, tail_chunks=1, tau=8, tau_history_div=1 << 30, policy="full")
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=res))
    short = prompt(30, 6)
    sched = Scheduler(eng, None, frozenset(), max_batch=2, sequence_tokens=256)
    try:
        (alone,) = run_jobs(sched, [short], 30)
        results, done = {}, threading.Semaphore(0)
        sched.submit(Job(prompt(240, 7), 40, Sampling(), lambda t: False, **outcome(0, results, done)))
        sched.submit(Job(short, 30, Sampling(), lambda t: False, **outcome(1, results, done)))
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        assert isinstance(results[0], KVFlashError) and "policy" in str(results[0])
        assert results[1][0] == alone
        assert run_jobs(sched, [prompt(30, 8)], 3)[0]
    finally:
        sched.close()


def test_a_request_that_fails_a_batched_step_and_ends_in_its_recovery_fails_no_other(lm) -> None:
    """The request growing past its budget raises inside the step that decodes its 18th token; the
    recovery first hands on the 17th, at which its consumer ends it (a stop string, say): the one
    request left from that step of two is stepped alone, not failed with the other's error."""
    res = ResidencyConfig(chunk_tokens=16, tail_chunks=1, tau=8, tau_history_div=1 << 30, policy="full")
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=res))
    sched = Scheduler(eng, None, frozenset(), max_batch=2, sequence_tokens=256)
    seen = [0]

    def stops_at_17(tok: int) -> bool:
        seen[0] += 1
        return seen[0] == 17

    try:
        results, done = {}, threading.Semaphore(0)
        sched.submit(Job(prompt(30, 6), 30, Sampling(), lambda t: False, **outcome(1, results, done)))
        sched.submit(Job(prompt(240, 7), 40, Sampling(), stops_at_17, **outcome(0, results, done)))
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        sched.close()
    assert len(results[0][0]) == 17 and len(results[1][0]) == 30, results


def test_a_request_submitted_while_the_scheduler_closes_is_refused_not_left_waiting(lm) -> None:
    """`close` answers what was submitted before it; a request submitted meanwhile would queue behind
    the loop's end, so it is refused (SchedulerDown) and nothing is left in flight."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=2)
    held, results, done = threading.Event(), {}, threading.Semaphore(0)
    first = Job(prompt(30, 1), 6, Sampling(), lambda t: not held.wait(30), **outcome(0, results, done))
    sched.submit(first)
    closing = threading.Thread(target=sched.close)
    closing.start()
    deadline = time.monotonic() + 30
    while not sched._closing:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(SchedulerDown):
        sched.submit(Job(prompt(30, 2), 6, Sampling(), lambda t: False, **outcome(1, results, done)))
    held.set()
    closing.join(60)
    assert done.acquire(timeout=30) and isinstance(results[0], tuple) and 1 not in results
    assert sched.in_flight == 0 and not sched._thread.is_alive()


def test_a_waiting_request_whose_client_left_or_whose_time_is_up_ends_while_it_waits(lm) -> None:
    """With the batch full, a queued request whose client has gone and one past its time limit end
    at once (Cancelled, TimedOut), not once a place comes: they count as waiting no longer, and
    the answer running goes on."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=1)
    results, done, running = {}, threading.Semaphore(0), [0]

    def slow(tok: int) -> bool:
        running[0] += 1
        time.sleep(0.01)
        return False

    try:
        sched.submit(Job(prompt(30, 1), 400, Sampling(), slow, **outcome(0, results, done)))
        while not running[0]:
            time.sleep(0.01)
        gone = threading.Event()
        sched.submit(
            Job(prompt(30, 2), 4, Sampling(), lambda t: False, gone=gone, **outcome(1, results, done))
        )
        sched.submit(
            Job(prompt(30, 3), 4, Sampling(), lambda t: False, timeout_s=0.3, **outcome(2, results, done))
        )
        gone.set()
        assert done.acquire(timeout=30) and done.acquire(timeout=30)
        ended_at = running[0]
        assert isinstance(results[1], Cancelled) and isinstance(results[2], TimedOut), results
        assert ended_at < 400 and 0 not in results and sched.waiting == 0  # the long answer still runs
        assert done.acquire(timeout=60) and len(results[0][0]) == 400
    finally:
        sched.close()


def test_a_request_timing_out_after_its_first_tokens_says_how_far_it_got(lm) -> None:
    """A request sent back to prefill after a damaged stored chunk has streamed tokens: if its time
    runs out before it answers again, its error says how many it answered, not that it ended
    before its first token; one that answered nothing says so."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=1)
    results, done = {}, threading.Semaphore(0)
    try:
        for i, answered in enumerate((3, 0)):
            job = Job(
                prompt(30, i), 8, Sampling(), lambda t: False, timeout_s=0.0, **outcome(i, results, done)
            )
            job.gen = Generation(8, Sampler(Sampling(), lm.device))
            job.gen.out = list(range(answered))
            assert sched._ended_early(job) and done.acquire(timeout=5)
    finally:
        sched.close()
    assert isinstance(results[0], TimedOut) and "3 tokens into its answer" in str(results[0])
    assert "first token" not in str(results[0])
    assert isinstance(results[1], TimedOut) and "before its first token" in str(results[1])


def test_calls_queued_while_the_batch_is_full_are_no_waiting_requests(lm) -> None:
    """A `call` wakes the loop through its queue; with the batch full it is run between steps, and
    neither it nor its wake-up counts as a request waiting (which would keep `quiet` clear)."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=1)
    results, done, ran = {}, threading.Semaphore(0), []

    def slow(tok: int) -> bool:
        time.sleep(0.01)
        return False

    try:
        sched.submit(Job(prompt(30, 1), 200, Sampling(), slow, **outcome(0, results, done)))
        deadline = time.monotonic() + 30
        while not sched._running:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(5):
            sched.call(lambda: ran.append(1))
        while len(ran) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sched.waiting == 0 and sched.in_flight == 1 and sched.quiet.is_set()
        assert done.acquire(timeout=60)
    finally:
        sched.close()


def test_a_request_whose_client_left_stops_at_the_next_prefill_piece(lm) -> None:
    """The long prompt prefills in 8 pieces of 32 tokens, one per round beside a decoding request;
    its client leaving at that request's third token ends it within a round, before any token."""
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=RES, prefill_step_tokens=32))
    sched = Scheduler(eng, None, frozenset(), max_batch=2)
    events: list[str] = []
    submitted, long_gone, ended = threading.Event(), threading.Event(), threading.Event()

    def short_token(tok: int) -> bool:
        events.append("short: token")
        if len(events) == 1:  # hold the scheduler until the long request is queued
            assert submitted.wait(30)
        if events.count("short: token") == 3:
            long_gone.set()
        return False

    def long_token(tok: int) -> bool:
        events.append("long: token")
        return False

    def long_error(e: BaseException) -> None:
        events.append(f"long: {e}")
        ended.set()

    try:
        sched.submit(Job(prompt(20, 1), 12, Sampling(), short_token, lambda *a: None, events.append))
        sched.submit(
            Job(prompt(250, 2), 4, Sampling(), long_token, lambda *a: ended.set(), long_error, long_gone)
        )
        submitted.set()
        assert ended.wait(60)
        assert run_jobs(sched, [prompt(30, 5)], 3)[0]
    finally:
        sched.close()
    assert "long: token" not in events, events
    (end,) = [i for i, e in enumerate(events) if e.startswith("long:")]
    assert "went away" in events[end] and events[:end].count("short: token") <= 4, events
    assert eng.pool.n_free == eng.pool.n_slots


def test_a_request_ended_before_its_first_token_gives_back_the_sequence_it_continued(lm) -> None:
    """Turn 2 continues turn 1's live sequence, and its client leaves while it prefills (32-token
    pieces beside a decoding request). Turn 1's whole chunks stay live: turn 2 sent again continues
    them instead of prefilling the conversation cold."""
    eng = Engine(lm, EngineConfig(pool_tokens=512, residency=RES, prefill_step_tokens=32))
    sched = Scheduler(eng, None, frozenset(), max_batch=2)
    results, done, queued, gone = {}, threading.Semaphore(0), threading.Event(), threading.Event()

    def short_token(tok: int) -> bool:
        if not queued.is_set():  # hold the scheduler until turn 2 is queued
            assert queued.wait(30)
        elif not gone.is_set():
            gone.set()  # turn 2 has its sequence and one piece by the next token
        return False

    try:
        first = prompt(100, 1)
        (out,) = run_jobs(sched, [first], 4)
        held = (len(first) + len(out)) // 16
        turn2 = first + out + prompt(160, 3)
        sched.submit(Job(prompt(20, 9), 12, Sampling(), short_token, **outcome(0, results, done)))
        sched.submit(Job(turn2, 4, Sampling(), lambda t: False, gone=gone, **outcome(1, results, done)))
        queued.set()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        assert isinstance(results[1], KVFlashError) and "went away" in str(results[1])
        sched.submit(Job(turn2, 4, Sampling(), lambda t: False, **outcome(2, results, done)))
        assert done.acquire(timeout=60)
        _, stats = results[2]
        assert stats.source == "memory" and stats.restored_tokens == held * 16
    finally:
        sched.close()


def test_an_eager_restore_waits_for_the_host_slots_a_running_job_is_owed(lm, tmp_path) -> None:
    """A 42-chunk prompt over a budget of 8 evicts into all 40 of the host tier's slots; a request
    whose 6 stored chunks restore eagerly keeps a host copy of each, so it is admitted once those
    slots are free, not beside it, where the evicting request found the tier full and failed."""
    host = 40 * chunk_bytes(CFG, 16, torch.bfloat16)

    def new_engine() -> Engine:
        return Engine(lm, EngineConfig(pool_tokens=24 * 16, host_bytes=host, residency=RES))

    doc = prompt(6 * 16, 2)
    with SnapshotStore(tmp_path / "store", workers=2) as store:
        snaps = KVSnapshots(store, new_engine().fingerprint)
        eng = new_engine()
        kv = eng.new_sequence()
        eng.prefill(kv, doc)
        snaps.save(kv, "doc")
        kv.free()
        sched = Scheduler(new_engine(), snaps, frozenset(), max_batch=4, sequence_tokens=8 * 16)
        try:
            results, done = {}, threading.Semaphore(0)
            sched.submit(Job(prompt(42 * 16, 1), 4, Sampling(), lambda t: False, **outcome(0, results, done)))
            sched.submit(Job(doc + prompt(5, 9), 4, Sampling(), lambda t: False, **outcome(1, results, done)))
            assert done.acquire(timeout=120) and done.acquire(timeout=120)
            assert not isinstance(results[0], BaseException), results[0]
            assert results[1][1].source == "disk" and results[1][1].restored_tokens == 6 * 16
        finally:
            sched.close()


@pytest.mark.parametrize("policy", ["qk", "full"])
def test_max_context_tokens_is_what_one_sequence_holds(lm, policy: str) -> None:
    """A prompt of max_context_tokens prefills, and one longer by the budget cannot (pool and host
    tier hold fewer chunks): the server's default prompt limit is what the engine holds, not the
    model's trained context."""
    res = ResidencyConfig(chunk_tokens=16, tail_chunks=1, policy=policy)
    chunk = CFG.kv_bytes_per_token(torch.float32) * 16
    eng = Engine(lm, EngineConfig(pool_tokens=256, residency=res, host_bytes=20 * chunk, kv_dtype="fp32"))
    sched = Scheduler(eng, None, frozenset(), max_batch=2, sequence_tokens=128)
    try:
        limit = sched.max_context_tokens
        assert limit == (20 if policy == "qk" else 8) * 16
        over = limit + (9 * 16 if policy == "qk" else 16)  # qk: more chunks than host and pool hold
        for n, fits in ((limit, True), (over, False)):
            kv = sched.cache._new()
            try:
                eng.prefill(kv, prompt(n, 0))
                assert fits
            except KVFlashError:
                assert not fits
            finally:
                sched.cache.drop(kv)
    finally:
        sched.close()


def test_a_request_sharing_a_busy_requests_document_waits_for_its_prefill_and_shares_its_chunks(
    lm,
) -> None:
    """Two prompts over one 100-token document, submitted together: the second waits for the first's
    prefill and shares the document's whole chunks in the pool, instead of computing them beside
    it; both answers are the ones each gets alone."""
    doc = prompt(100, 70)
    prompts = [doc + prompt(9, 71), doc + prompt(12, 72)]
    alone = []
    for ids in prompts:
        sched = Scheduler(engine(lm), None, frozenset(), max_batch=1)
        try:
            alone += run_jobs(sched, [ids], 6)
        finally:
            sched.close()
    stats: list = []
    done = threading.Semaphore(0)

    def job(ids: list[int]) -> Job:
        def finished(out, st, kv) -> None:
            stats.append((ids, out, st))
            done.release()

        return Job(
            ids, 6, Sampling(), lambda tok: False, finished, lambda e: (stats.append(e), done.release())
        )

    sched = Scheduler(engine(lm), None, frozenset(), max_batch=4)
    try:
        for ids in prompts:
            sched.submit(job(ids))
        assert done.acquire(timeout=120) and done.acquire(timeout=120)
    finally:
        sched.close()
    (first_ids, first, one), (second_ids, second, two) = stats
    assert [first_ids, second_ids] == prompts and [first, second] == alone
    assert one.source == "cold" and two.source == "shared" and two.restored_tokens == 96  # 6 chunks of 16


def test_requests_over_one_document_compare_and_hash_each_prompt_once(lm, monkeypatch) -> None:
    """Eight prompts of different lengths over one 200-token document, submitted together: seven
    wait for the first's prefill, then are admitted together. A waiting prompt is compared with a
    busy one at most once however many rounds it waits, and the chunk keys of each whole-chunk
    prefix are hashed once (admission and `take` both ask for them): repeated comparisons and
    hashes of long documents took a server's scheduler most of a second at 32 conversations."""
    compared: list[tuple[int, int]] = []
    hashed: list[int] = []

    def compare(a: list[int], b: list[int], block: int = 64) -> int:
        compared.append((len(a), len(b)))
        return common_prefix(a, b, block)

    def chain(fp: str, tokens, chunk_tokens: int) -> list[str]:
        hashed.append(len(tokens))
        return chain_hashes(fp, tokens, chunk_tokens)

    monkeypatch.setattr(scheduler_module, "common_prefix", compare)
    monkeypatch.setattr(prefix_cache_module, "chain_hashes", chain)
    doc = prompt(200, 80)
    prompts = [doc + prompt(5 + i, 81 + i) for i in range(8)]
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=8)
    try:
        run_jobs(sched, prompts, 2)
    finally:
        sched.close()
    assert compared and len(set(compared)) == len(compared), compared
    # whole-chunk prefixes: the document's 12 chunks, or 13 with a prompt's own first tokens
    whole = {tuple(ids[: (len(ids) - 1) // 16 * 16]) for ids in prompts}
    assert len(hashed) == len(whole), hashed


def alone_answers(lm, prompts: list[list[int]], max_tokens: int, pool_tokens: int) -> list[list[int]]:
    """Each prompt's answer from a scheduler that serves it alone."""
    out = []
    for ids in prompts:
        sched = Scheduler(engine(lm, pool_tokens), None, frozenset(), max_batch=1)
        try:
            out += run_jobs(sched, [ids], max_tokens)
        finally:
            sched.close()
    return out


def test_thirty_short_requests_run_together_in_a_pool_one_long_prompt_fills(lm) -> None:
    """Admission by room: thirty 20-token chats reserve 3 chunks each (prompt, answer, append head)
    of a 128-chunk pool whose whole is one sequence's budget, so they decode together instead of
    one after another; each answer is the one it gets alone."""
    prompts = [prompt(20, 100 + i) for i in range(30)]
    alone = alone_answers(lm, prompts, 6, 2048)
    sched = Scheduler(engine(lm, 2048), None, frozenset(), max_batch=32)
    try:
        assert sched.budget == sched.engine.pool.n_slots == 128
        got = run_jobs(sched, prompts, 6)
        assert sched.batched / sched.steps >= 10, (sched.batched, sched.steps)
    finally:
        sched.close()
    assert got == alone


def test_a_prompt_without_room_waits_at_the_head_of_the_queue(lm) -> None:
    """A 470-token prompt reserves 31 of 32 chunks and cannot start beside a running chat; the chat
    queued after it does not overtake it, though it would fit: it starts once the long one ends."""
    short, long_, later = prompt(20, 1), prompt(470, 2), prompt(25, 3)
    alone = alone_answers(lm, [short, long_, later], 6, 512)
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=8)
    events: list[str] = []
    submitted = threading.Event()
    results, done = {}, threading.Semaphore(0)

    def first_token(name: str):
        def on_token(tok: int) -> bool:
            if name == "short" and not submitted.is_set():
                assert submitted.wait(30)  # the others queue while this chat runs
            if f"{name}: token" not in events:
                events.append(f"{name}: token")
            return False

        return on_token

    def job(i: int, name: str, ids: list[int]) -> Job:
        kw = outcome(i, results, done)
        finished = kw.pop("on_done")

        def on_done(out, stats, kv) -> None:
            events.append(f"{name}: done")
            finished(out, stats, kv)

        return Job(ids, 6, Sampling(), first_token(name), on_done, **kw)

    try:
        sched.submit(job(0, "short", short))
        sched.submit(job(1, "long", long_))
        sched.submit(job(2, "later", later))
        submitted.set()
        for _ in range(3):
            assert done.acquire(timeout=120)
    finally:
        sched.close()
    assert [results[i][0] for i in range(3)] == alone
    assert events.index("long: token") > events.index("short: done"), events
    assert events.index("later: token") > events.index("long: done"), events
    assert sched.engine.pool.n_free == sched.engine.pool.n_slots


def idle_room_run(lm, host_chunks: int) -> tuple[Scheduler, list[list[int]], list[int], list[int]]:
    """Three 100-token chats kept live, then a 400-token prompt beginning as the last one that needs
    nearly the whole 32-chunk pool; the host tier holds `host_chunks` chunks."""
    chats = [prompt(100, 20 + i) for i in range(3)]
    big = chats[2] + prompt(300, 30)
    (alone,) = alone_answers(lm, [big], 6, 512)
    chunk = CFG.kv_bytes_per_token(torch.float32) * RES.chunk_tokens
    eng = Engine(
        lm, EngineConfig(pool_tokens=512, residency=RES, host_bytes=host_chunks * chunk, kv_dtype="fp32")
    )
    sched = Scheduler(eng, None, frozenset(), max_batch=8)
    outs = run_jobs(sched, chats, 4)
    assert len(sched.cache.idle) == 3 and sched.cache.idle[-1].seq.tokens[:100] == chats[2]
    (got,) = run_jobs(sched, [big], 6)
    assert got == alone and all(len(o) == 4 for o in outs)
    return sched, chats, outs, big


def test_idle_sequences_are_parked_in_the_host_tier_for_a_prompt_that_needs_their_room(lm) -> None:
    """The older chats leave the pool for the host tier and stay live: the next turn of one of them
    continues it from memory, with the answer a cold prefill of that conversation gets."""
    sched, chats, outs, _ = idle_room_run(lm, host_chunks=64)
    try:
        parked = [kv for kv in sched.cache.idle if kv.seq.tokens[:100] != chats[2]]
        assert len(parked) == 2 and all(not kv.resident() for kv in parked)
        assert all(any(ch.host is not None for ch in kv.seq.chunks) for kv in parked)
        again = chats[0] + outs[0] + prompt(20, 40)
        (cold,) = alone_answers(lm, [again], 6, 512)
        results, done = {}, threading.Semaphore(0)
        sched.submit(Job(again, 6, Sampling(), lambda t: False, **outcome(0, results, done)))
        assert done.acquire(timeout=60)
        out, stats = results[0]
        assert stats.source == "memory" and stats.restored_tokens == 96  # its 6 whole chunks
        assert out == cold
    finally:
        sched.close()


def test_idle_sequences_are_freed_when_the_host_tier_has_no_room(lm) -> None:
    """With a host tier too small to park them, the older chats are freed, never the one whose
    chunks the long prompt shares (it stays beside the long prompt's sequence)."""
    sched, chats, _, _ = idle_room_run(lm, host_chunks=4)
    try:
        assert [kv.seq.tokens[:100] for kv in sched.cache.idle] == [chats[2], chats[2]]
    finally:
        sched.close()


def test_chats_too_short_to_park_are_freed_so_idle_sequences_stay_within_the_pool(lm) -> None:
    """Chats shorter than a chunk hold only their append head; parking one would leave an empty live
    sequence, which holds no slot and so was never freed: 200 of them one after another leave at
    most a pool's worth of idle sequences, each holding a slot."""
    sched = Scheduler(engine(lm, pool_tokens=256), None, frozenset(), max_batch=4)
    try:
        for i in range(0, 200, 20):
            run_jobs(sched, [prompt(6, 1000 + i + j) for j in range(20)], 2)
        idle = sched.cache.idle
        assert 0 < len(idle) <= sched.engine.pool.n_slots
        assert all(kv.seq.chunks for kv in idle)
        assert len(sched.cache._made) == len(idle)
    finally:
        sched.close()


def test_a_parked_sequence_keeps_the_summaries_of_its_chunks_only(lm) -> None:
    """A sequence's summaries grow in steps of 64 chunks; a parked one keeps a row per sealed chunk,
    so the idle sequences the host tier holds cost summaries in proportion to their host slots."""
    sched, chats, _, _ = idle_room_run(lm, host_chunks=64)
    try:
        parked = [kv for kv in sched.cache.idle if not kv.resident()]
        assert len(parked) == 2
        for kv in parked:
            assert kv.seq.summaries.shape[0] == kv.seq.n_sealed == len(kv.seq.chunks)
    finally:
        sched.close()


def test_calls_run_on_the_scheduler_thread_between_steps_and_while_it_waits(lm) -> None:
    """`call` runs its function on the scheduler's thread: at once when it waits for work, and
    between steps while requests run; one that raises is warned and every request still answers."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=4)
    try:
        ran: list[tuple[str, bool]] = []
        done = threading.Event()
        sched.call(lambda: (ran.append(("idle", threading.current_thread() is sched._thread)), done.set()))
        assert done.wait(10) and ran == [("idle", True)]

        steps: list[int] = []

        def during(_: int) -> bool:
            if len(steps) == 2:  # from inside a step's callback: runs before the next step
                sched.call(lambda: steps.append(-sched.steps))
                sched.call(lambda: 1 / 0)
            steps.append(sched.steps)
            return False

        outs: list[list[int]] = []
        finished = threading.Event()
        job = Job(prompt(40, 1), 6, Sampling(), during, lambda out, *_: (outs.append(out), finished.set()),
                  lambda e: finished.set(), min_tokens=6)  # fmt: skip
        with pytest.warns(UserWarning, match="a call on the scheduler's thread failed: division by zero"):
            sched.submit(job)
            assert finished.wait(30)
        assert len(outs[0]) == 6
        # on_token runs while the step after its token's runs (the one `steps` counts last): the
        # call queued there runs once that step has ended, before the next one
        i = steps.index(next(s for s in steps if s < 0))
        assert -steps[i] == steps[i - 1] == steps[i + 1] - 1
    finally:
        sched.close()


def test_quiet_is_clear_while_a_request_waits_for_its_first_token(lm) -> None:
    """`quiet` (what a server's snapshot saves wait for) is clear from a request's arrival until its
    first token, and set while requests only decode and while the loop waits for work."""
    sched = Scheduler(engine(lm), None, frozenset(), max_batch=4)
    try:
        assert sched.quiet.is_set()
        seen: list[bool] = []
        finished = threading.Event()

        def during(_: int) -> bool:
            seen.append(sched.quiet.is_set())
            return False

        job = Job(prompt(40, 1), 6, Sampling(), during, lambda out, *_: finished.set(),
                  lambda e: finished.set(), min_tokens=6)  # fmt: skip
        sched.submit(job)
        assert finished.wait(30)
        assert seen == [False] + [True] * 5
        assert sched.quiet.is_set()
    finally:
        sched.close()


def test_a_steps_tokens_reach_their_consumer_while_the_next_step_runs(lm) -> None:
    """A greedy decode step's tokens stay on the device: the next step is launched with them there,
    then they are read back and handed to `on_token` while it runs (the first token, from the
    prefill, and an answer's last, at max_tokens, at once). An answer `on_token` ends, or a stop id
    read back ends, has run that one step more, whose token is dropped: its sequence holds every
    token of the answer (and the stop id)."""
    answer_of_6, seen, ends, fed, launched = run_counted(lm, frozenset(), [(6, None)])
    # (forwards launched, steps counted) as each token is handed over
    assert seen == [(1, 1), (3, 3), (4, 4), (5, 5), (6, 6), (6, 6)]
    assert fed == 4  # steps 3-6 took the last step's tokens on the device; step 2 the prefill's
    ((out, held),) = ends
    assert out == answer_of_6 and len(out) == 6 and held == 40 + 5  # the last token is not fed

    _, seen, ends, _, launched = run_counted(lm, frozenset(), [(20, 3)])  # its consumer ends it at 3
    ((out, held),) = ends
    assert out == answer_of_6[:3] and held == 40 + 3  # the step after the third ran, its token dropped
    assert launched == 4  # the prefill, two steps for tokens 2 and 3, one more

    k = next(i for i in range(1, 6) if answer_of_6[i] not in answer_of_6[:i])
    _, seen, ends, _, launched = run_counted(lm, frozenset({answer_of_6[k]}), [(20, None)], min_tokens=0)
    ((out, held),) = ends
    assert out == answer_of_6[:k] and held == 40 + k + 1  # the stop id was fed, its step's token dropped
    assert launched == 1 + k + 1


def test_tokens_chosen_on_the_device_keep_the_min_tokens_rule(lm) -> None:
    """Tokens chosen on the device (`greedy_tokens`) follow `Generation.choose`'s rule: no stop id
    before min_tokens (the next likeliest id instead), then the stop id ends the answer; the answer
    is the one-sequence decode loop's."""
    answer_of_6 = run_counted(lm, frozenset(), [(6, None)])[0]
    stop = answer_of_6[1]
    _, _, ends, fed, _ = run_counted(lm, frozenset({stop}), [(12, None)], min_tokens=4)
    ((out, _),) = ends
    eng = engine(lm)
    kv = eng.new_sequence(256)
    logits = eng.prefill(kv, prompt(40, 1))
    gen = Generation(12, Sampler(Sampling(), eng.lm.device), frozenset({stop}), min_tokens=4)
    alone = decode(eng.decode_step(kv), logits, len(kv.seq), gen)
    assert fed > 0 and out == alone and len(out) >= 4 and stop not in out
    assert stop in answer_of_6[:4]  # the rule held a stop id back


def run_counted(
    lm: LoadedModel,
    stop_ids: frozenset[int],
    jobs: list[tuple[int, int | None]],
    min_tokens: int | None = None,
) -> tuple[list[int], list[tuple[int, int]], list[tuple[list[int], int]], int, int]:
    """Runs (max_tokens, on_token ends it at this token) jobs of one prompt, one after the other,
    on a scheduler of `stop_ids` (min_tokens: max_tokens unless given), counting its forwards.
    Returns the first answer, (forwards, sched.steps) at each on_token, each (answer, tokens its
    sequence holds), the forwards that took their tokens on the device, and the forwards."""
    sched = Scheduler(engine(lm), None, stop_ids, max_batch=4)
    launched = fed = 0
    forward = sched.engine.forward

    def counted(seqs, tokens, pieces):
        nonlocal launched, fed
        launched += 1
        fed += isinstance(tokens, torch.Tensor)
        return forward(seqs, tokens, pieces)

    sched.engine.forward = counted
    seen: list[tuple[int, int]] = []
    ends: list[tuple[list[int], int]] = []
    done = threading.Semaphore(0)

    def job(max_tokens: int, stop_at: int | None) -> Job:
        def during(_: int) -> bool:
            seen.append((launched, sched.steps))
            return len(seen) == stop_at

        def answered(out, stats, kv) -> None:
            ends.append((out, len(kv.seq)))
            done.release()

        mins = max_tokens if min_tokens is None else min_tokens
        return Job(prompt(40, 1), max_tokens, Sampling(), during, answered, lambda e: done.release(),
                   min_tokens=mins)  # fmt: skip

    try:
        for max_tokens, stop_at in jobs:
            sched.submit(job(max_tokens, stop_at))
            assert done.acquire(timeout=30)
    finally:
        sched.close()
    return ends[0][0], seen, ends, fed, launched


def test_the_admission_memo_keeps_no_freed_sequence_alive(lm) -> None:
    """`HeldCache` remembers what each sequence holds until a slot changes readers; a sequence freed
    since is not kept alive by it (an idle or closed server would keep its memory)."""
    eng = engine(lm)
    held_by = HeldCache(eng.pool, eng.host)
    kv = eng.new_sequence(256)
    eng.prefill(kv, prompt(40, 1))
    held = held_by(kv)
    assert held_by(kv) is held and len(held.gpu) == 3  # two sealed chunks of 16 and the append head
    gone = weakref.ref(kv)
    kv.free()
    del kv
    gc.collect()
    assert gone() is None


def test_host_slots_a_staged_snapshot_holds_are_not_room_an_idle_sequence_gives_back(lm) -> None:
    """Freeing an idle, parked sequence gives its host slots back, but not the ones a staged snapshot
    also reads (`HostTier.hold`): admission counts only what freeing would free."""
    eng = engine(lm)
    kv = eng.new_sequence(256)
    eng.prefill(kv, prompt(40, 1))
    kv.park()  # two sealed chunks, each in a host slot now
    idle = Holdings()
    idle.add(Held.of(kv))
    assert idle.beyond(host_refs=eng.host.refs) == Room(0, 2)
    staged = kv.seq.chunks[0].host
    eng.host.hold(staged)  # a snapshot's copy of the first chunk
    idle = Holdings()
    idle.add(Held.of(kv))
    assert idle.beyond(host_refs=eng.host.refs) == Room(0, 1)
    assert idle.beyond() == Room(0, 2)  # what the idle sequences hold, a shared slot once
    eng.host.release(staged)
    kv.free()
