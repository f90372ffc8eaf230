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
from kvflash.storage.errors import ChunkError
from kvflash.storage.format import HEADER_SIZE, parse_header
from kvflash.storage.index import Index
from kvflash.storage.local_backend import LocalDirBackend
from kvflash.storage.records import ChunkRow

RECOVERED_PREFIX = "recovered:"


def set_aside(path: Path) -> Path:
    """Renames a damaged index (and its WAL files) out of the way, keeping it for inspection."""
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-wal", "-shm"):
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
