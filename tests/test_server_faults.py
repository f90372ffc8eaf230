"""Store faults under a serving server, over real HTTP on 127.0.0.1 with the real default model: a
disk that fills during a save and during a restore, and an index another process holds. Every
request is answered as a cold prefill answers it (with a warning where the store could not serve),
the server's usage is back to its baseline after, and no snapshot that verified before is lost.
Marked `reliability`: `make test-reliability` runs them."""

from __future__ import annotations

import os
import subprocess
import time
import warnings
from pathlib import Path

import httpx
import pytest
import torch

from kvflash.serve.server import Server
from kvflash.storage import SnapshotStore
from tests.test_server import MODEL, caught_up, serving, settled
from tests.test_server_reliability import stray
from tests.test_storage_crash import ledger
from tests.test_storage_damage import _fill, _mount, hold_index

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def lm(smollm_path):
    from kvflash.models.loader import load_model

    return load_model(smollm_path, device="cpu")


@pytest.fixture(scope="module")
def cold(lm) -> dict[tuple[int, int], str]:
    """Each conversation's answer from a server without a store."""
    with serving(lm, None, max_tokens=4) as (url, _):
        return {(c, t): answer(url, ledger(c, t))[0] for c in (0, 1) for t in (1, 2)}


def answer(url: str, messages: list[dict]) -> tuple[str, str]:
    """(the answer, where its prompt's KV came from)."""
    body = {"model": MODEL, "messages": messages, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["kvflash"]["source"]


def written(server: Server) -> None:
    """Waits until the answers so far are staged and their snapshots written (or failed), the
    deferred ones too."""
    settled(server)
    caught_up(server)


def pinned_witness(root: Path) -> tuple[str, list]:
    """The store's one snapshot, pinned (a save of its conversation adds a snapshot beside it
    instead of replacing it), with its KV read back."""
    with SnapshotStore(root, workers=2) as st:
        (snap,) = st.list_snapshots()
        st.pin(snap.id)
        full = st.get_snapshot(snap.id)
        return snap.id, st.read_chunks_parallel(full.chunk_hashes, full.fingerprint)


def intact(root: Path, sid: str, blobs: list) -> None:
    """The store verifies, holds no temp file of a failed save, and the witness is bit-exact."""
    with SnapshotStore(root, workers=2) as st:
        report = st.verify()
        assert report.ok and report.orphan_files == 0, report
        snap = st.get_snapshot(sid)
        got = st.read_chunks_parallel(snap.chunk_hashes, snap.fingerprint)
    assert all(torch.equal(a.kv, b.kv) for a, b in zip(blobs, got, strict=True))


def messages_of(caught: list[warnings.WarningMessage]) -> str:
    return "\n".join(str(w.message) for w in caught)


def test_a_disk_that_fills_costs_snapshots_never_answers(lm, cold, tmp_path) -> None:
    """A save that runs out of space midway, then a restore and a save on a disk with no block
    left: each request answers as a cold prefill does, the failed saves leave no file and only
    warn, and once space is freed the next answer is saved again."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], "mount a 64 MiB tmpfs")
    try:
        root = mnt / "store"
        with serving(lm, root, max_tokens=4) as (url, server):
            assert answer(url, ledger(0, 1))[0] == cold[0, 1]
            written(server)
            sid, blobs = pinned_witness(root)
            filler = _fill(mnt)
            os.truncate(filler, os.stat(filler).st_size - (2 << 20))  # room for part of a save
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert answer(url, ledger(1, 1))[0] == cold[1, 1]  # its save needs more than 2 MiB
                written(server)
                _fill(mnt)
                assert os.statvfs(mnt).f_bavail == 0
                assert answer(url, ledger(0, 2))[0] == cold[0, 2]  # restores on a full disk
                written(server)
            said = messages_of(caught)
            assert said.count("could not save the snapshot: no space left") == 2, said
            assert stray(server) == (0, 0, 0)
            intact(root, sid, blobs)
            os.unlink(filler)
            assert answer(url, ledger(1, 2))[0] == cold[1, 2]
            written(server)
        with SnapshotStore(root, workers=2) as st:
            assert len(st.list_snapshots()) == 2 and st.verify().ok
        intact(root, sid, blobs)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_an_index_another_process_holds_delays_saves_not_answers(lm, cold, tmp_path) -> None:
    """While a second process holds the index's write lock: a stored conversation's next turn goes
    cold after the lease's bounded wait, with a warning that says why, and a new conversation is
    answered too (its lookup does not wait behind the save queued before it). The saves commit once
    the lock is released."""
    root = tmp_path / "store"
    with serving(lm, root, max_tokens=4) as (url, server):
        answer(url, ledger(0, 1))
        written(server)
    sid, blobs = pinned_witness(root)
    with serving(lm, root, max_tokens=4) as (url, server):  # nothing live: turn 2 needs the store
        release = hold_index(root)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                assert answer(url, ledger(0, 2)) == (cold[0, 2], "cold")
                assert answer(url, ledger(1, 1))[0] == cold[1, 1]  # its save queues behind the first
                took = time.monotonic() - t0
            said = messages_of(caught)
            assert "cannot lease" in said and "locked" in said, said
            assert took < 30, f"the answers waited {took:.0f} s for the held index"
        finally:
            release()
        written(server)
        assert stray(server) == (0, 0, 0)
    with SnapshotStore(root, workers=2) as st:
        assert len(st.list_snapshots()) == 3  # the witness and both new turns' snapshots
    intact(root, sid, blobs)
