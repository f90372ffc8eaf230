"""Sessions on the real model: every restore path gives the cold answer, damage falls back to cold."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.eval.haystack import filler_sentences
from kvflash.models.loader import load_model
from kvflash.serve.prompt import content_start, encode_messages
from kvflash.serve.session import Document, Session, system_message
from kvflash.serve.snapshots import APPROX_SUFFIX, KVSnapshots
from kvflash.storage import SnapshotStore

FACT = "The lighthouse of Port Elden was built in 1843 by an engineer named Mara Quill."
Q1 = "Who built the lighthouse of Port Elden?"
Q2 = "In which year was the lighthouse built?"
MAX = 16


def document(n_sentences: int = 30, seed: int = 7) -> Document:
    sents = filler_sentences(random.Random(seed))
    body = [next(sents) for _ in range(n_sentences)]
    body.insert(n_sentences // 3, FACT)
    return Document("town.txt", " ".join(body))


@pytest.fixture(scope="module")
def lm(smollm_path):
    return load_model(smollm_path, dtype="fp32", device="cpu")


def engine(lm, pool_tokens: int = 4096, policy: str = "qk") -> Engine:
    return Engine(lm, EngineConfig(pool_tokens=pool_tokens, residency=ResidencyConfig(policy=policy)))


def turns(sess: Session, questions: list[str]) -> list:
    out = [sess.ask(q, MAX) for q in questions]
    sess.close()
    return out


@pytest.fixture(scope="module")
def cold(lm):
    """Answers with no store at all: the reference every restore path must reproduce."""
    doc = document()
    return {
        "one": turns(Session(engine(lm), [doc]), [Q1])[0][0],
        "two": [a for a, _ in turns(Session(engine(lm), [doc]), [Q1, Q2])],
        "q2_only": turns(Session(engine(lm), [doc]), [Q2])[0][0],
    }


def test_memory_and_disk_restore_in_the_same_process_equal_cold(lm, cold, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path) as store:
        (a1, s1), (a2, s2) = turns(Session(engine(lm), [doc], store, name="s"), [Q1, Q2])
        assert s1.source == "cold" and s2.source == "memory"
        assert [a1, a2] == cold["two"]
        assert s2.restored_tokens > 0 and s2.prefilled_tokens < 40
        # A new session object in the same process: the stateless prompt restores from disk.
        ((b, sb),) = turns(Session(engine(lm), [doc], store), [Q2])
        assert sb.source == "disk" and sb.restored_tokens > 0 and sb.restored_tokens % 64 == 0
        assert b == cold["q2_only"]


def test_a_new_session_takes_the_documents_ids_from_the_snapshot(lm, tmp_path, monkeypatch) -> None:
    # A document whose last tokens lie past the last full chunk: they come from the stored tail.
    tok = lm.tokenizer
    for n in range(20, 80):
        doc = document(n)
        system = system_message([doc])
        end = content_start(tok, [system]) + len(tok.encode_plain(system["content"]))
        if 1 <= end % 64 <= 8:
            break
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        sess = Session(engine(lm), [doc], store)
        expected = encode_messages(tok, [system, {"role": "user", "content": Q2}])
        real, lengths = tok.encode_plain, []
        monkeypatch.setattr(tok, "encode_plain", lambda text: lengths.append(len(text)) or real(text))
        ((_, sb),) = turns(sess, [Q2])
        assert sess.ids[: len(expected)] == expected
        assert max(lengths) < len(doc.text)  # the question was tokenised, the document was not
        assert sb.source == "disk" and sb.restored_tokens < end


def test_restore_through_decode_workers_equals_cold(lm, cold, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path, processes=2) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        store.processes.wait()
        ((b, sb),) = turns(Session(engine(lm), [doc], store), [Q2])
        assert sb.source == "disk" and store.processes.decoded == sb.restored_tokens // 64 > 1
    assert b == cold["q2_only"]


def test_lazy_restore_with_budget_holding_the_context_equals_cold(lm, cold, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        ((b, sb),) = turns(Session(engine(lm), [doc], store, lazy=True), [Q2])
        (snap,) = store.list_snapshots()  # turn 2's snapshot replaced turn 1's, and took over its hit
        assert snap.id == sb.snapshot_id and snap.hits == 1
    assert sb.source == "lazy" and sb.restored_tokens > 0
    assert sb.bytes_moved["disk"] > 0
    assert b == cold["q2_only"]


def test_named_session_resumes_in_a_new_process(lm, cold, tmp_path, smollm_path) -> None:
    doc_file = tmp_path / "town.txt"
    doc_file.write_text(document().text)
    env = {**os.environ, "KVFLASH_HOME": str(tmp_path / "home")}

    def ask(q: str) -> dict:
        cmd = [
            sys.executable,
            "-m",
            "kvflash.cli.app",
            "ask",
            str(doc_file),
            q,
            "--session",
            "t",
            "--model",
            str(smollm_path),
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "-n",
            str(MAX),
            "--json",
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    first, second = ask(Q1), ask(Q2)
    assert first["source"] == "cold" and second["source"] == "disk"
    assert second["restored_tokens"] > first["prefilled_tokens"] - 64
    assert [first["answer"], second["answer"]] == cold["two"]


def test_prefix_that_diverges_mid_chunk_restores_the_aligned_part(lm, tmp_path) -> None:
    doc = document()
    changed = Document(doc.name, doc.text[:-40] + " And then the tide came in.")
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        ((b, sb),) = turns(Session(engine(lm), [changed], store), [Q1])
    ((ref, _),) = turns(Session(engine(lm), [changed]), [Q1])
    assert sb.source == "disk" and sb.restored_tokens % 64 == 0 and sb.restored_tokens > 0
    assert b == ref


def _damage_one_chunk(root: Path) -> None:
    """Flips a payload byte of chunk 1 of the snapshot: inside any document prefix."""
    with SnapshotStore(root) as store:
        (snap,) = store.list_snapshots()
        h = store.get_snapshot(snap.id).chunk_hashes[1]
    victim = root / "chunks" / h[:2] / f"{h}.kvc"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_corrupted_snapshot_warns_and_prefills_cold(lm, cold, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        _damage_one_chunk(tmp_path)
        n_snapshots = len(store.list_snapshots())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ((b, sb),) = turns(Session(engine(lm), [doc], store), [Q2])
        assert b == cold["q2_only"]
        assert sb.source == "cold" and sb.restored_tokens == 0
        assert any("unusable" in str(w.message) for w in caught)
        # Nothing was deleted, and the turn's own snapshot rewrote the damaged chunk from fresh KV.
        assert len(store.list_snapshots()) == n_snapshots
        assert store.verify().ok


def test_damaged_lazy_restore_warns_and_answers_as_cold(lm, cold, tmp_path) -> None:
    """A lazy restore reads chunk KV only when it is selected: the damaged chunk fails its check
    mid-prefill; the turn goes on cold, and the damaged snapshot counts no hit."""
    doc = document()
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store), [Q1])
        _damage_one_chunk(tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ((b, sb),) = turns(Session(engine(lm), [doc], store, lazy=True), [Q2])
        assert b == cold["q2_only"]
        assert sb.source == "cold" and sb.restored_tokens == 0
        assert any("unusable" in str(w.message) for w in caught)
        assert [s.hits for s in store.list_snapshots()] == [0]


def test_a_session_keeps_and_skips_snapshots_another_engine_made(lm, cold, tmp_path) -> None:
    """One session name on one store, run with another chunk size (another fingerprint): that run
    neither resumes the conversation from KV it cannot use nor deletes it, so the first engine's
    next turn still restores its snapshot."""
    doc = document()
    other = Engine(lm, EngineConfig(pool_tokens=4096, residency=ResidencyConfig(chunk_tokens=32)))
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store, name="s"), [Q1])
        (mine,) = store.list_snapshots()
        sess = Session(other, [doc], store, name="s")
        assert len(sess.messages) == 1  # a new conversation: the stored one is another engine's
        turns(sess, [Q1])
        assert mine.id in {s.id for s in store.list_snapshots()} and len(store.list_snapshots()) == 2
        ((a2, s2),) = turns(Session(engine(lm), [doc], store, name="s"), [Q2])
    assert s2.source == "disk" and a2 == cold["two"][1]


def test_a_conversation_stored_with_another_kv_dtype_resumes_and_prefills_cold_with_a_warning(
    lm, cold, tmp_path
) -> None:
    """The same model with fp32 KV after a bf16-KV turn (`auto` on the CPU): the conversation goes
    on (its token ids are this model's), its KV is computed again, a warning says why, and the
    bf16 snapshot stays for the engine that can restore it."""
    doc = document()
    fp32 = Engine(lm, EngineConfig(pool_tokens=4096, kv_dtype="fp32"))
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [doc], store, name="s"), [Q1])
        (bf16,) = store.list_snapshots()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess = Session(fp32, [doc], store, name="s")
        assert [str(w.message) for w in caught] == [
            "the stored KV of this conversation is bf16; this engine keeps fp32 KV (--kv-dtype), "
            "so it computes the KV again"
        ]
        assert len(sess.messages) == 3  # the conversation resumed
        ((_, s2),) = turns(sess, [Q2])
        assert s2.source == "cold" and s2.restored_tokens == 0
        assert bf16.id in {s.id for s in store.list_snapshots()} and len(store.list_snapshots()) == 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its own KV is stored: nothing to warn about
            again = Session(engine(lm), [doc], store, name="s")
        assert len(again.messages) == 5  # both turns
        ((_, s3),) = turns(again, [Q1])
    assert s3.source == "disk" and s3.restored_tokens >= bf16.n_tokens  # turn 1's bf16 KV


def test_a_pinned_snapshot_is_kept_and_the_turn_still_answers(lm, cold, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path) as store:
        sess = Session(engine(lm), [doc], store, name="s")
        sess.ask(Q1, MAX)
        (pinned,) = store.list_snapshots()
        store.pin(pinned.id)
        a2, s2 = sess.ask(Q2, MAX)
        sess.close()
        assert a2 == cold["two"][1] and s2.snapshot_id not in (None, pinned.id)
        assert {s.id for s in store.list_snapshots()} == {pinned.id, s2.snapshot_id}


def test_damage_is_reported_by_verify(lm, tmp_path) -> None:
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm), [document()], store), [Q1])
        _damage_one_chunk(tmp_path)
        report = store.verify()
    assert not report.ok and len(report.damaged) == 1


def test_foreign_fingerprint_snapshot_is_not_restored(lm, tmp_path) -> None:
    doc = document()
    with SnapshotStore(tmp_path) as store:
        sess = Session(engine(lm), [doc], store)
        sess.snapshots.fp = "0" * 32  # as if another model had written the store
        turns(sess, [Q1])
        ((_, sb),) = turns(Session(engine(lm), [doc], store), [Q1])
    assert sb.source == "cold"


def test_lazy_restore_under_a_small_budget_reads_only_what_it_selects(lm, tmp_path) -> None:
    doc = document(n_sentences=60)
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm, pool_tokens=512), [doc], store), [Q1])
        sess = Session(engine(lm, pool_tokens=512), [doc], store, lazy=True)
        sess.snapshots.prefetch = False  # count the on-demand reads alone
        ((_, sb),) = turns(sess, [Q2])
    chunk_bytes = lm.config.kv_bytes_per_token(sess.engine.kv_dtype) * 64
    assert sb.source == "lazy" and sb.restored_tokens >= 12 * 64
    assert 0 < sb.bytes_moved["disk"] <= 8 * chunk_bytes < sb.restored_tokens // 64 * chunk_bytes
    assert sb.resident_chunks <= 8


def test_a_lazy_scout_that_reads_every_chunk_selects_as_an_eager_restore(lm, tmp_path) -> None:
    """Read for the scout and scored from their keys (`scout_reads`), a lazy restore's chunks are
    selected as a restore that read them all selects them; the reads count as disk bytes."""
    doc, seen = document(n_sentences=60), {}
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm, pool_tokens=512), [doc], store), [Q1])
        for name, lazy, reads in (("eager", False, 0), ("lazy", True, 0), ("reads", True, 1000)):
            cfg = EngineConfig(pool_tokens=512, residency=ResidencyConfig(scout_reads=reads))
            sess = Session(Engine(lm, cfg), [doc], store, lazy=lazy)
            sess.snapshots.prefetch = False
            _, stats = sess.ask(Q2, 1)
            seen[name] = sorted(ch.index for ch in sess.kv.resident()), stats
            sess.close()
    assert seen["reads"][1].source == "lazy" and seen["eager"][1].source == "disk"
    assert seen["reads"][0] == seen["eager"][0]
    assert seen["reads"][1].bytes_moved["disk"] > seen["lazy"][1].bytes_moved["disk"]


def test_kv_computed_under_eviction_never_stands_in_for_exact_kv(lm, tmp_path) -> None:
    doc = document(n_sentences=60)
    with SnapshotStore(tmp_path) as store:
        ((_, small),) = turns(Session(engine(lm, pool_tokens=512), [doc], store), [Q1])
        assert [s.fingerprint.endswith(APPROX_SUFFIX) for s in store.list_snapshots()] == [True]
        # A budget that holds the context computes exact KV: it must not restore the evicting run's.
        ((_, full),) = turns(Session(engine(lm), [doc], store), [Q2])
        assert full.source == "cold"  # and its exact snapshot replaced the other under the label
        assert [s.fingerprint.endswith(APPROX_SUFFIX) for s in store.list_snapshots()] == [False]
        # A sequence that evicts anyway takes exact KV too.
        ((_, again),) = turns(Session(engine(lm, pool_tokens=512), [doc], store, lazy=True), [Q2])
        assert again.source == "lazy" and again.restored_tokens >= small.prefilled_tokens // 64 * 64 - 64
        # Its approximate snapshot does not replace the exact one that a full budget needs.
        assert sorted(s.fingerprint.endswith(APPROX_SUFFIX) for s in store.list_snapshots()) == [False, True]


def test_closing_a_lazy_session_stops_its_prefetch(lm, tmp_path) -> None:
    """A prefetch re-takes the fetch lock batch after batch; closing must not wait for it to read
    the whole document (the lock is not fair)."""
    doc = document(n_sentences=60)
    with SnapshotStore(tmp_path) as store:
        turns(Session(engine(lm, pool_tokens=512), [doc], store), [Q1])
        sess = Session(engine(lm, pool_tokens=512), [doc], store, lazy=True)
        sess.snapshots.prefetch = False
        sess.ask(Q2, MAX)
        kv = sess.kv
        on_disk = sum(ch.gpu is None and ch.host is None and ch.disk is not None for ch in kv.seq.chunks)
        read_before = kv.moved["disk"]
        prefetch = threading.Thread(target=KVSnapshots._prefetch, args=(kv, 1))
        prefetch.start()
        sess.close()
        prefetch.join()
    assert on_disk >= 4
    assert (kv.moved["disk"] - read_before) // kv.chunk_nbytes < on_disk


@pytest.mark.parametrize("absolute", [False, True])
def test_ask_and_chat_choose_the_position_scheme(smollm_path, tmp_path, absolute: bool) -> None:
    from kvflash.cli.ask_cmd import close_session, open_session
    from kvflash.cli.engine_options import EngineOptions

    doc_file = tmp_path / "town.txt"
    doc_file.write_text(document().text)
    engine = EngineOptions(
        model=smollm_path, dtype="fp32", device="cpu", pool_tokens="1024", absolute_positions=absolute
    )
    sess = open_session(
        [doc_file], engine, session=None, lazy=None, store=tmp_path, no_store=absolute,
        store_processes=0 if absolute else 1,
    )  # fmt: skip
    try:
        assert sess.engine.cfg.residency.cache_positions is not absolute
        if not absolute:  # the store's worker processes follow --store-processes
            assert sess.snapshots.store.processes.n == 1
    finally:
        close_session(sess)


def test_a_full_host_tier_names_the_flag_that_raises_it(smollm_path, tmp_path) -> None:
    """A host tier of no chunk under a pool that must evict: the one-line error names --host-bytes,
    a flag `ask` takes."""
    doc_file = tmp_path / "town.txt"
    doc_file.write_text(document(n_sentences=60).text)
    cmd = [sys.executable, "-m", "kvflash.cli.app", "ask", str(doc_file), Q1, "--host-bytes", "1",
           "--pool-tokens", "512", "--no-store", "--model", str(smollm_path), "--device", "cpu",
           "-n", "2"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "the host tier is full" in r.stderr and "--host-bytes" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
