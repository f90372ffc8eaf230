"""The store under faults it must refuse or survive: damaged chunk files, index rows that disagree with
them, a full disk, and names from users that try to leave the store."""

from __future__ import annotations

import subprocess
import tracemalloc

import pytest
import torch

from kvflash.storage import (
    ChunkCorrupt,
    ChunkMissing,
    DiskFull,
    ForeignFingerprint,
    InvalidName,
    SizeMismatch,
    SnapshotStore,
    UnsupportedVersion,
    codec,
    format,
)
from kvflash.storage.codec import Codec
from tests.store_util import (
    FP,
    B,
    C,
    D,
    H,
    L,
    chunk_path,
    flip,
    make_chain,
    noise_chain,
    rewrite_header,
    toks,
)

# corruption


CORRUPTIONS = {
    # restores skip the stored crc32 where zstd checks the frame: the refusal says "payload: zstd ..."
    "payload byte": (lambda p: flip(p, -10), ChunkCorrupt, "payload"),
    "payload byte, mid-frame": (lambda p: flip(p, p.stat().st_size * 3 // 4), ChunkCorrupt, "payload"),
    "header byte": (lambda p: flip(p, 40), ChunkCorrupt, "header checksum"),
    "token byte": (lambda p: flip(p, format.HEADER_SIZE + 1), ChunkCorrupt, "chain hash"),
    "bad magic": (lambda p: flip(p, 0), ChunkCorrupt, "magic"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-7]), SizeMismatch, "the file has"),
    "truncated header": (lambda p: p.write_bytes(p.read_bytes()[:50]), ChunkCorrupt, "truncated"),
    "empty file": (lambda p: p.write_bytes(b""), ChunkCorrupt, "truncated"),
    "missing file": (lambda p: p.unlink(), ChunkMissing, "missing"),
    "foreign fingerprint": (
        lambda p: rewrite_header(p, fingerprint="fp-other"),
        ForeignFingerprint,
        "fp-other",
    ),
    "unknown version": (lambda p: rewrite_header(p, version=99), UnsupportedVersion, "version 99"),
    "raw length 2**40": (lambda p: rewrite_header(p, raw_len=1 << 40), SizeMismatch, "raw length"),
    "stored length 2**40": (lambda p: rewrite_header(p, stored_len=1 << 40), SizeMismatch, "stored length"),
    "huge shape": (lambda p: rewrite_header(p, shape=(1 << 31, 2, H, C, D)), SizeMismatch, "shape"),
    "zero summary blocks": (lambda p: rewrite_header(p, summary_blocks=0), SizeMismatch, "0 summary blocks"),
    "summary blocks not dividing C": (
        lambda p: rewrite_header(p, summary_blocks=3),
        SizeMismatch,
        "3 summary blocks",
    ),
    "summary blocks 2**31": (lambda p: rewrite_header(p, summary_blocks=1 << 31), SizeMismatch, "summary"),
    "summary blocks that divide C, raw length does not agree": (  # the summary's residual is raw
        lambda p: rewrite_header(p, summary_blocks=C),
        SizeMismatch,
        "raw length",
    ),
    "shape and raw agree, the frame does not": (  # refused before the raw length is allocated
        lambda p: rewrite_header(p, shape=(L, 2, H, C, 4096), raw_len=_raw_len((L, 2, H, C, 4096))),
        ChunkCorrupt,
        "declares",
    ),
}


def _raw_len(shape: tuple[int, ...]) -> int:
    """The least raw length of a bf16 chunk file of this shape: the KV's, then the summary's."""
    return codec.raw_bounds(Codec.LOSSLESS_BF16, torch.bfloat16, shape)[0] + 4 * L * H * B * shape[4]


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_detected_and_refused(store, kind) -> None:
    damage, error, message = CORRUPTIONS[kind]
    blobs = make_chain(toks(3))
    sid = store.put_snapshot("s", FP, blobs)
    victim = blobs[1].chain_hash
    damage(chunk_path(store.root, victim))

    tracemalloc.start()
    with pytest.raises(error, match=message):
        store.read_chunk(victim, FP)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"refusing a bad chunk allocated {peak} bytes"

    report = store.verify(sid)
    assert not report.ok and [d.chunk_hash for d in report.damaged] == [victim]
    assert report.damaged[0].snapshots == (sid,)
    assert store.read_chunk(blobs[0].chain_hash, FP).index == 0  # its neighbours still serve
    if error is not UnsupportedVersion:
        assert store.find_longest_prefix(FP, [b.chain_hash for b in blobs]) == 1
        store.put_snapshot("again", FP, blobs)  # saving the same chunk again repairs it
        assert store.verify().ok


def test_index_rows_that_disagree_with_files_are_reported(store) -> None:
    blobs = make_chain(toks(2))
    sid = store.put_snapshot("s", FP, blobs)
    store.index.db.conn.execute("UPDATE chunks SET refcount = 5 WHERE hash = ?", (blobs[0].chain_hash,))
    report = store.verify()
    assert any("refcount" in e and blobs[0].chain_hash in e for e in report.index_errors)
    assert store.verify(sid).index_errors == []  # refcounts are a whole-store check


# disk full


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(
            f"cannot mount a 2 MiB tmpfs here (needs root or CAP_SYS_ADMIN): {r.stderr.decode().strip()}"
        )
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_cleanly_and_keeps_older_data(tiny_fs) -> None:
    with SnapshotStore(tiny_fs / "store", level=1, workers=2) as st:
        first = noise_chain(2, start=0)
        sid = st.put_snapshot("first", FP, first)
        with pytest.raises(DiskFull, match="no space"):
            st.put_snapshot("too big", FP, noise_chain(12, start=10_000))
        assert not list(tiny_fs.rglob("*.tmp"))
        assert [s.id for s in st.list_snapshots()] == [sid]
        assert sorted(st.backend.list_hashes()) == sorted(b.chain_hash for b in first)
        got = st.read_chunks_parallel(st.get_snapshot(sid).chunk_hashes, FP)
        assert all(torch.equal(a.kv, b.kv) for a, b in zip(first, got, strict=True))
        assert st.verify().ok
        st.put_snapshot("work goes on", FP, noise_chain(1, start=20_000))
        assert len(st.list_snapshots()) == 2 and st.verify().ok


# names from users


BAD_IDS = ["../x", "../../etc/passwd", "/etc/passwd", "abc\0def0123", "", "..", "ABCDEF012345", "a" * 13]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_ids_cannot_reach_outside_the_store(store, bad) -> None:
    for op in (store.get_snapshot, store.pin, store.unpin, store.rm, store.verify):
        with pytest.raises(InvalidName):
            op(bad)


@pytest.mark.parametrize("bad", ["../" * 10 + "etc/passwd", "/etc/passwd", "0" * 63 + "\0", "G" * 64])
def test_hashes_cannot_reach_outside_the_store(store, bad) -> None:
    with pytest.raises(InvalidName):
        store.read_chunk(bad, FP)
    with pytest.raises(InvalidName):
        store.find_longest_prefix(FP, [bad])
    with pytest.raises(InvalidName):
        with store.lease([bad]):
            pass
    with pytest.raises(InvalidName):
        store.put_snapshot("x", FP, [bad])


def test_labels_are_text_never_paths(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        for label in ("../../escape", "/etc/passwd", "a/b\\c", "..", "unicodé 文档"):
            sid = st.put_snapshot(label, FP, make_chain(toks(1)))
            assert st.get_snapshot(sid).label == label
        for label in ("nul\0byte", "new\nline", "x" * 201):
            with pytest.raises(InvalidName):
                st.put_snapshot(label, FP, make_chain(toks(1)))
        with pytest.raises(InvalidName):
            st.put_snapshot("ok", "../fp", make_chain(toks(1)))
    assert {p.name for p in tmp_path.iterdir()} == {"store"}
    assert {p.name for p in root.iterdir()} <= {
        "chunks",
        "lock",
        "index.sqlite",
        "index.sqlite-wal",
        "index.sqlite-shm",
        "reserve",
        "owners",
    }
