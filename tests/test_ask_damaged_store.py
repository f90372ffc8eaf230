"""`kvflash ask` over a store damaged in each way an operator, a full disk or another program can
damage it: the answer is always given (the same greedy answer as a cold prefill), with a warning
where the store could not serve, and afterwards the store verifies or names exactly what was
damaged. The store only saves time; it never costs an answer."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from kvflash.storage import SnapshotStore
from tests.test_cli_inputs import kvflash
from tests.test_storage_damage import hold_index

QUESTION = "Who built the harbour light?"
DOC = " ".join(
    f"Entry {i}: the harbour light of Port Elden was tended by keeper number {i} in the year {1800 + i}."
    for i in range(9)
)


def _chunk_files(root: Path) -> list[Path]:
    return sorted((root / "chunks").glob("*/*.kvc"))


def _tree(top: Path) -> dict[str, tuple[int, int]]:
    """Regular files under top, not through symlinks: relative path -> (size, crc32)."""
    out = {}
    for d, _, files in os.walk(top):
        for f in files:
            p = Path(d) / f
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(top))] = (p.stat().st_size, zlib.crc32(p.read_bytes()))
    return out


def _held_index(root: Path, outside: Path) -> Callable[[], None]:
    """Another process's write transaction on the index, released after 8 s (past the 5 s a lease
    waits, so the restore goes cold; the save after the answer then commits)."""
    timer = threading.Timer(8, hold_index(root))
    timer.start()
    return timer.join


def _replace(kind: str) -> Callable[[Path, Path], None]:
    def damage(root: Path, outside: Path) -> None:
        victim = _chunk_files(root)[1]
        victim.unlink()
        if kind == "directory":
            victim.mkdir()
        elif kind == "fifo":
            os.mkfifo(victim)
        else:
            shutil.copy(_chunk_files(root)[0], outside / "foreign.kvc")
            victim.symlink_to(outside / "foreign.kvc")

    return damage


def _fanout_symlink(root: Path, outside: Path) -> None:
    fan = _chunk_files(root)[0].parent
    shutil.move(fan, outside / fan.name)
    fan.symlink_to(outside / fan.name)


def _sql(statement: str) -> Callable[[Path, Path], None]:
    def damage(root: Path, outside: Path) -> None:
        with sqlite3.connect(root / "index.sqlite") as c:
            c.execute(statement)

    return damage


def _flip(root: Path, outside: Path) -> None:
    f = _chunk_files(root)[0]
    buf = bytearray(f.read_bytes())
    buf[-5] ^= 0x40
    f.write_bytes(bytes(buf))


def _not_a_database(root: Path, outside: Path) -> None:
    for suffix in ("-wal", "-shm"):
        (root / f"index.sqlite{suffix}").unlink(missing_ok=True)
    (root / "index.sqlite").write_bytes(b"\0garbage" * 512)


def _lock_dir(root: Path, outside: Path) -> None:
    (root / "lock").unlink(missing_ok=True)
    (root / "lock").mkdir()


DAMAGE: dict[str, Callable[[Path, Path], object]] = {
    "none": lambda root, outside: None,
    "index not a database": _not_a_database,
    "meta not JSON": _sql("UPDATE snapshots SET meta = 'x{'"),
    "malformed hash row": _sql(
        "INSERT INTO chunks VALUES ('../../x', 'fp', 0, '', 64, 'lossless', 1, 1, 0, NULL, 0, 0)"
    ),
    "refcounts zero": _sql("UPDATE chunks SET refcount = 0"),
    "lock is a directory": _lock_dir,
    "chunk path is a directory": _replace("directory"),
    "chunk path is a FIFO": _replace("fifo"),
    "chunk file is a symlink": _replace("symlink"),
    "fan-out directory is a symlink": _fanout_symlink,
    "chunk file padded": lambda root, outside: os.truncate(_chunk_files(root)[0], 64 << 20),
    "chunk file truncated": lambda root, outside: os.truncate(_chunk_files(root)[0], 100),
    "payload byte flipped": _flip,
    "a chunk file deleted": lambda root, outside: _chunk_files(root)[-1].unlink(),
    "chunks/ deleted": lambda root, outside: shutil.rmtree(root / "chunks"),
    "index held by another writer": _held_index,
}
FAST = {"index not a database", "chunk path is a FIFO"}
"""In `make test`; every kind runs under `make test-reliability`."""


@pytest.fixture(scope="module")
def seeded(smollm_path, tmp_path_factory) -> tuple[Path, Path, str]:
    """A store holding the document's snapshot, and the cold answer."""
    base = tmp_path_factory.mktemp("seed")
    doc = base / "doc.txt"
    doc.write_text(DOC)
    store = base / "store"
    mp = pytest.MonkeyPatch()
    try:
        answer = _ask(smollm_path, doc, store, mp)
    finally:
        mp.undo()
    assert len(_chunk_files(store)) >= 3
    return doc, store, answer


def _ask_argv(smollm_path: Path, doc: Path, store: Path, *more: str) -> list[str]:
    """`kvflash ask` of the question about doc over store, four tokens, JSON out."""
    return ["ask", str(doc), QUESTION, "-n", "4", "--json", "--store", str(store), *more,
            "--model", str(smollm_path)]  # fmt: skip


def _ask(smollm_path: Path, doc: Path, store: Path, monkeypatch, capfd=None) -> str:
    argv = _ask_argv(smollm_path, doc, store, "--pool-tokens", "1024")
    if capfd is None:  # a module fixture has no capfd: the real command in a process of its own
        cmd = [sys.executable, "-m", "kvflash.cli.app", *argv, "--device", "cpu"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["answer"]
    code, out, err = kvflash([*argv, "--device", "cpu"], capfd, monkeypatch)
    assert code == 0 and "Traceback" not in err, err
    return json.loads(out)["answer"]


def _cases() -> list:
    return [pytest.param(k, id=k, marks=() if k in FAST else pytest.mark.reliability) for k in DAMAGE]


@pytest.mark.parametrize("kind", _cases())
def test_ask_answers_over_a_damaged_store(kind, seeded, smollm_path, tmp_path, capfd, monkeypatch) -> None:
    doc, seed_store, cold = seeded
    root, outside = tmp_path / "store", tmp_path / "outside"
    shutil.copytree(seed_store, root)
    outside.mkdir()
    intact = _tree(root / "chunks")
    finish = DAMAGE[kind](root, outside)
    left = _tree(root / "chunks")
    touched = {Path(p).stem for p in intact if left.get(p) != intact[p]}
    outside_before = _tree(outside)
    assert _ask(smollm_path, doc, root, monkeypatch, capfd) == cold
    if callable(finish):
        finish()
    assert _tree(outside) == outside_before, "the store wrote or deleted outside itself"
    with SnapshotStore(root, workers=2) as st:
        assert st.list_snapshots(), "the store lost every snapshot"
        report = st.verify()
    assert {d.chunk_hash for d in report.damaged} <= touched, report  # only what the damage broke
    assert not report.index_errors or kind in ("meta not JSON", "malformed hash row"), report


def _mount(args: list[str], what: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot {what} here (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")


@pytest.mark.reliability
def test_ask_answers_over_a_read_only_store(seeded, smollm_path, tmp_path, capfd, monkeypatch) -> None:
    doc, seed_store, cold = seeded
    root = tmp_path / "store"
    shutil.copytree(seed_store, root)
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount(["--bind", str(root), str(ro)], "bind-mount")
    try:
        _mount(["-o", "remount,bind,ro", str(ro)], "remount read-only")
        argv = _ask_argv(smollm_path, doc, ro)
        code, out, err = kvflash([*argv, "--device", "cpu"], capfd, monkeypatch)
        assert code == 0 and "Traceback" not in err, err
        result = json.loads(out)
        assert result["answer"] == cold and result["source"] == "disk"  # restored, without a lease
        assert "read-only" in err  # the save says why it could not
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_ask_answers_on_a_full_disk_and_prune_frees_it(
    seeded, smollm_path, tmp_path, capfd, monkeypatch
) -> None:
    doc, seed_store, cold = seeded
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], "mount a tmpfs")
    try:
        root = mnt / "store"
        shutil.copytree(seed_store, root)
        with SnapshotStore(root, workers=2):
            pass  # makes the reserve
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        for size in (1 << 20, 4096, 1):
            try:
                while os.write(fd, b"\1" * size):
                    pass
            except OSError:
                pass
        os.close(fd)
        assert os.statvfs(mnt).f_bavail == 0
        argv = _ask_argv(smollm_path, doc, root)
        code, out, err = kvflash([*argv, "--device", "cpu"], capfd, monkeypatch)
        assert code == 0 and "Traceback" not in err, err
        assert json.loads(out)["answer"] == cold
        code, out, err = kvflash(
            ["snapshot", "prune", "--max-bytes", "0", "--store", str(root), "--json"], capfd, monkeypatch
        )
        assert code == 0, err
        assert json.loads(out)["freed_bytes"] > 0 and os.statvfs(mnt).f_bavail > 0
        code, out, err = kvflash(
            ["snapshot", "verify", "--all", "--store", str(root), "--json"], capfd, monkeypatch
        )
        assert code == 0 and json.loads(out)["ok"], out + err
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
