"""An index rebuilt from the chunk files alone, for a store whose index file is damaged.

Every chunk file names itself and carries its fingerprint, position and parent (docs/FORMAT.md), so
the chunk rows come back whole and every chain that reaches back to the root becomes a snapshot again
(`recovered:<its last hash>`: labels and metadata lived only in the old index). A file that does not
parse, or holds another chunk than its name says, is left out: the next prune sweeps it. Summaries
files need no rows: a recovered chain's is named by its last hash, and the others are swept too.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvflash.storage.chunk import ROOT_HASH
from kvflash.storage.errors import ChunkError, StoreError
from kvflash.storage.format import HEADER_SIZE, parse_header
from kvflash.storage.index import Index
from kvflash.storage.local_backend import LocalDirBackend
from kvflash.storage.records import ChunkRow

RECOVERED_PREFIX = "recovered:"


_DB_FILES = ("", "-wal", "-shm")
"""An SQLite database in WAL mode: the file, its log and its shared memory."""


def rebuild_index(path: Path, backend: LocalDirBackend) -> tuple[Path | None, int]:
    """Builds an index from the chunk files under another name and only then puts it at `path`,
    setting the damaged one there (if any) aside: a rebuild that fails or is killed leaves the
    damaged index (or none) in place, which the next open rebuilds again, never a partial one that
    would look whole and whose missing rows the next prune would take for files to delete. Returns
    where the damaged index went and how many chunk files the new one took."""
    building = path.with_name(f"{path.name}.rebuilding")
    _remove_db(building)
    try:
        index = Index(building)
        try:
            n = rebuild(index, backend)
            index.db.checkpoint()
        finally:
            index.close()
        if any(building.with_name(building.name + s).exists() for s in _DB_FILES[1:]):
            raise StoreError(f"the rebuilt index {building} kept its WAL files; not put in place")
    except BaseException:
        _remove_db(building)
        raise
    # the damaged index and its WAL files go, whichever a rebuild killed midway left: a WAL beside
    # the new file would be replayed into it
    aside = set_aside(path) if any(path.with_name(path.name + s).exists() for s in _DB_FILES) else None
    building.replace(path)
    return aside, n


def _remove_db(path: Path) -> None:
    for suffix in _DB_FILES:
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def set_aside(path: Path) -> Path:
    """Renames a damaged index (and its WAL files) out of the way, keeping it for inspection; a
    name another damaged index took (the same second) gets a number."""
    stem = f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    aside, n = path.with_name(stem), 1
    while any(aside.with_name(aside.name + s).exists() for s in _DB_FILES):
        aside, n = path.with_name(f"{stem}-{n}"), n + 1
    for suffix in _DB_FILES:
        src = path.with_name(path.name + suffix)
        if src.exists() or src.is_symlink():
            src.replace(aside.with_name(aside.name + suffix))
    return aside


def rebuild(index: Index, backend: LocalDirBackend) -> int:
    """Fills an empty index from the chunk files; returns how many files it took."""
    rows: dict[str, ChunkRow] = {}
    for h, _ in backend.list_files():
        try:
            buf, size = backend.get_range(h, 0, HEADER_SIZE)
            head = parse_header(buf, size, h)
        except ChunkError:
            continue
        if head.chain_hash == h:
            rows[h] = ChunkRow.of(head)
    now = time.time()
    index.add_chunk_rows(list(rows.values()), now)
    parents = {r.parent_hash for r in rows.values()}
    for leaf in rows.values():
        if leaf.hash not in parents and (chain := _chain_to_root(leaf, rows)):
            label = f"{RECOVERED_PREFIX}{leaf.hash[:12]}"
            n_tokens = sum(rows[h].n_tokens for h in chain)
            index.add_snapshot(label, leaf.fingerprint, n_tokens, '{"recovered": true}', chain, [], now)
    return len(rows)


def _chain_to_root(leaf: ChunkRow, rows: dict[str, ChunkRow]) -> list[str] | None:
    chain, row = [leaf.hash], leaf
    while row.index > 0:
        parent = rows.get(row.parent_hash)
        if parent is None or parent.index != row.index - 1 or parent.fingerprint != row.fingerprint:
            return None
        chain.append(parent.hash)
        row = parent
    return chain[::-1] if row.parent_hash == ROOT_HASH else None
