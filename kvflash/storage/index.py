"""`Index`: every query of a store's SQLite index (the file itself: kvflash/storage/index_db.py).

The queries are one class because the index a store calls is one interface, which `RedisIndex`
implements method for method (kvflash/storage/redis_index.py), and because a removal decides and
deletes inside one of its transactions.
"""

from __future__ import annotations

import os
import socket
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from kvflash.storage.errors import ChunkCorrupt, ChunkMissing, SnapshotNotFound
from kvflash.storage.index_db import IndexDb
from kvflash.storage.locking import LEASE_TTL_S
from kvflash.storage.names import is_hash, new_snapshot_id
from kvflash.storage.records import (
    BAD_META,
    ChunkRow,
    PruneDecision,
    PruneInput,
    Snapshot,
    SnapshotInfo,
    parse_meta,
)

BEST_EFFORT_BUSY_S = 5.0
"""How long bookkeeping a restore can do without (a lease, a hit, a damage mark) waits for a busy
index before it gives up: the answer does not wait a minute for a writer that holds the index."""
_BATCH = 500
"""Hashes per `IN (...)` query, under SQLite's bound-variable limit."""


class Index:
    def __init__(self, path: Path | str, read_only: bool = False):
        self.db = IndexDb(path, read_only)

    def close(self) -> None:
        self.db.close()

    def size_bytes(self) -> int:
        """Bytes of the index's files: the database, its WAL and its shared memory."""
        files = [Path(f"{self.db.path}{s}") for s in ("", "-wal", "-shm")]
        return sum(f.stat().st_size for f in files if f.exists())

    # chunks

    def chunk_rows(self, hashes: Iterable[str]) -> dict[str, ChunkRow]:
        out: dict[str, ChunkRow] = {}
        hashes = list(hashes)
        with self.db.read() as c:
            for batch in _batches(hashes):
                marks = ",".join("?" * len(batch))
                for r in c.execute(f"SELECT {_CHUNK_COLS} FROM chunks WHERE hash IN ({marks})", batch):
                    out[r[0]] = ChunkRow(*r)
        return out

    def intact(self, hashes: Sequence[str], fingerprint: str) -> set[str]:
        """Which of hashes are indexed under fingerprint and not marked damaged (as `chunk_rows`
        would say), without building their rows: a lookup asks it of a whole prompt's chunks."""
        out: set[str] = set()
        with self.db.read() as c:
            for batch in _batches(hashes):
                marks = ",".join("?" * len(batch))
                query = (
                    f"SELECT hash FROM chunks WHERE hash IN ({marks}) AND fingerprint = ? "
                    "AND (damaged IS NULL OR damaged = '')"
                )
                out.update(r[0] for r in c.execute(query, (*batch, fingerprint)))
        return out

    def all_chunk_rows(self) -> dict[str, ChunkRow]:
        return {r[0]: ChunkRow(*r) for r in self.db.query(f"SELECT {_CHUNK_COLS} FROM chunks")}

    def mark_damaged(self, chunk_hash: str, reason: str | None) -> None:
        """A damaged chunk is no longer offered as a prefix, and the next save of it rewrites it.
        None clears the mark (verify found the file intact)."""
        with self.db.write(BEST_EFFORT_BUSY_S) as c:
            c.execute("UPDATE chunks SET damaged = ? WHERE hash = ?", (reason and reason[:500], chunk_hash))

    def record_hit(self, hashes: list[str], now: float) -> None:
        """A committed restore: its chunks and every snapshot ending a shared prefix there move up."""
        with self.db.write(BEST_EFFORT_BUSY_S) as c:
            for batch in _batches(hashes):
                marks = ",".join("?" * len(batch))
                c.execute(f"UPDATE chunks SET last_used = ? WHERE hash IN ({marks})", (now, *batch))
            c.execute(
                "UPDATE snapshots SET hits = hits + 1, last_used = ? WHERE id IN "
                "(SELECT snapshot_id FROM snapshot_chunks WHERE hash = ? AND position = ?)",
                (now, hashes[-1], len(hashes) - 1),
            )

    def add_chunk_rows(self, rows: list[ChunkRow], now: float) -> None:
        """Rows of files already durable and checked, referenced by no snapshot yet (an index being
        rebuilt, chunks copied from another tier): a row there already is the file's now, no longer
        damaged."""
        with self.db.write() as c:
            c.executemany(_PUT_CHUNK, [_row_values(r, now) for r in rows])

    # snapshots

    def add_snapshot(
        self,
        label: str,
        fingerprint: str,
        n_tokens: int,
        meta_json: str,
        hashes: list[str],
        new_rows: list[ChunkRow],
        now: float,
        succeeds: Sequence[str] = (),
        snapshot_id: str | None = None,
    ) -> str:
        """One transaction: the new chunk rows (files already durable), the snapshot, its members.
        The snapshot starts with the hits of the snapshots it `succeeds` (a session's newer prefix).
        A `snapshot_id` given (a copy from another tier keeps its id) that is here already is that
        snapshot, copied before: nothing changes."""
        taken = "SELECT 1 FROM snapshots WHERE id = ?"
        with self.db.write() as c:
            if snapshot_id and c.execute(taken, (snapshot_id,)).fetchone():
                return snapshot_id
            c.executemany(_PUT_CHUNK, [_row_values(r, now) for r in new_rows])
            for batch in _batches(hashes):
                marks = ",".join("?" * len(batch))
                found = {r[0] for r in c.execute(f"SELECT hash FROM chunks WHERE hash IN ({marks})", batch)}
                if missing := [h for h in batch if h not in found]:
                    raise ChunkMissing(missing[0], "referenced by the new snapshot but not stored")
            while not snapshot_id or c.execute(taken, (snapshot_id,)).fetchone():
                snapshot_id = new_snapshot_id()
            marks = ",".join("?" * len(succeeds))
            query = f"SELECT COALESCE(SUM(hits), 0) FROM snapshots WHERE id IN ({marks})"
            (hits,) = c.execute(query, tuple(succeeds)).fetchone()
            c.execute(
                "INSERT INTO snapshots (id, label, fingerprint, n_tokens, n_chunks, created, last_used, "
                "meta, hits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (snapshot_id, label, fingerprint, n_tokens, len(hashes), now, now, meta_json, hits),
            )
            c.executemany(
                "INSERT INTO snapshot_chunks (snapshot_id, position, hash) VALUES (?, ?, ?)",
                [(snapshot_id, i, h) for i, h in enumerate(hashes)],
            )
        return snapshot_id

    def snapshots(self) -> list[SnapshotInfo]:
        return [_snapshot_info(r) for r in self.db.query(_snapshot_query() + " ORDER BY s.created")]

    def snapshot(self, snapshot_id: str) -> Snapshot:
        with self.db.read() as c:
            row = c.execute(_snapshot_query("WHERE s.id = ?"), (snapshot_id,)).fetchone()
            if row is None:
                raise SnapshotNotFound(f"no snapshot {snapshot_id}")
            hashes = [
                r[0]
                for r in c.execute(
                    "SELECT hash FROM snapshot_chunks WHERE snapshot_id = ? ORDER BY position",
                    (snapshot_id,),
                )
            ]
        for h in hashes:
            if not is_hash(h):
                raise ChunkCorrupt(repr(h), f"snapshot {snapshot_id} lists a malformed chunk hash")
        return Snapshot(**vars(_snapshot_info(row)), chunk_hashes=tuple(hashes))

    def chains_through(self, chunk_hash: str, position: int) -> list[str]:
        """The last chunk of every snapshot whose chain holds this chunk at this position, and so
        starts with its whole prefix (a chain hash names every chunk before it), shortest first."""
        return [
            r[0]
            for r in self.db.query(
                "SELECT last.hash FROM snapshot_chunks sc JOIN snapshots s ON s.id = sc.snapshot_id "
                "JOIN snapshot_chunks last ON last.snapshot_id = s.id AND last.position = s.n_chunks - 1 "
                "WHERE sc.hash = ? AND sc.position = ? GROUP BY last.hash ORDER BY MIN(s.n_chunks)",
                (chunk_hash, position),
            )
        ]

    def chain_ends(self) -> set[str]:
        """The last chunk of every snapshot's chain: what names its summaries file."""
        return {
            r[0]
            for r in self.db.query(
                "SELECT sc.hash FROM snapshot_chunks sc JOIN snapshots s ON s.id = sc.snapshot_id "
                "AND sc.position = s.n_chunks - 1"
            )
        }

    def ends_a_chain(self, chunk_hash: str) -> bool:
        """Whether some snapshot's chain ends with this chunk (`chain_ends`, asked of one)."""
        return bool(
            self.db.query(
                "SELECT 1 FROM snapshot_chunks sc JOIN snapshots s ON s.id = sc.snapshot_id "
                "AND sc.position = s.n_chunks - 1 WHERE sc.hash = ? LIMIT 1",
                (chunk_hash,),
            )
        )

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        with self.db.write() as c:
            n = c.execute("UPDATE snapshots SET pinned = ? WHERE id = ?", (int(pinned), snapshot_id)).rowcount
            if not n:
                raise SnapshotNotFound(f"no snapshot {snapshot_id}")

    def members(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for sid, h in self.db.query(
            "SELECT snapshot_id, hash FROM snapshot_chunks ORDER BY snapshot_id, position"
        ):
            out.setdefault(sid, []).append(h)
        return out

    def remove(
        self,
        decide: Callable[[PruneInput], PruneDecision],
        dry_run: bool,
        now: float,
        owner_alive: Callable[[str], bool | None],
        only: str | None = None,
    ) -> PruneDecision:
        """Runs a removal policy on a consistent view and applies it in the same transaction, so no
        lease or save can slip in between the decision and the deletion. Files are the caller's to
        unlink after this returns; a crash in between leaves orphan files, never dangling rows.

        The snapshots' member lists are the truth about references: refcounts that disagree with
        them are recomputed first, and no chunk a snapshot lists is deleted whatever its refcount.
        `only`: the policy decides about that snapshot alone (`rm`), so the view holds its row, its
        chunks' rows and the member lists' entries of its chunks, not the whole store's: a session's
        save removes the snapshot it replaces at a cost of that snapshot's size, however many others
        the store holds."""
        with self.db.read() if dry_run else self.db.write() as c:
            dead, gone = self._dead_leases(c, now, owner_alive)
            if not dry_run:
                c.executemany("DELETE FROM leases WHERE id = ?", [(lid,) for lid in dead])
            leased = {h for lid, h in c.execute("SELECT lease_id, hash FROM lease_chunks") if lid not in dead}
            if only is None:
                inp = PruneInput(
                    snapshots=[_snapshot_info(r) for r in c.execute(_snapshot_query())],
                    members=self.members(),
                    chunks=self.all_chunk_rows(),
                    leased=leased,
                )
                decision = decide(inp).sized(inp.chunks)
            else:
                inp = _one_snapshot_view(c, only, leased)
                stored = c.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM chunks").fetchone()[0]
                decision = decide(inp).sized(inp.chunks, stored)
            decision.gone_owners = gone
            if not dry_run:
                if only is None:
                    c.execute(f"UPDATE chunks SET refcount = ({_REFS}) WHERE refcount != ({_REFS})")
                else:
                    for batch in _batches(list(inp.chunks)):
                        marks = ",".join("?" * len(batch))
                        c.execute(
                            f"UPDATE chunks SET refcount = ({_REFS}) WHERE hash IN ({marks}) "
                            f"AND refcount != ({_REFS})",
                            batch,
                        )
                c.executemany("DELETE FROM snapshots WHERE id = ?", [(s,) for s in decision.snapshots])
                c.executemany(
                    "DELETE FROM chunks WHERE hash = ? AND hash NOT IN (SELECT hash FROM snapshot_chunks) "
                    "AND hash NOT IN (SELECT hash FROM lease_chunks)",
                    [(h,) for h in decision.chunks],
                )
        return decision

    # leases

    def add_lease(self, lease_id: str, owner: str, hashes: list[str], now: float) -> None:
        """Marks chunks as in use by a restore; every one must still be stored, or nothing is leased."""
        with self.db.write(BEST_EFFORT_BUSY_S) as c:
            for batch in _batches(hashes):
                marks = ",".join("?" * len(batch))
                found = {r[0] for r in c.execute(f"SELECT hash FROM chunks WHERE hash IN ({marks})", batch)}
                if missing := [h for h in batch if h not in found]:
                    raise ChunkMissing(missing[0], "not stored (pruned or never saved)")
            c.execute(
                "INSERT INTO leases (id, pid, host, heartbeat, owner) VALUES (?, ?, ?, ?, ?)",
                (lease_id, os.getpid(), socket.gethostname(), now, owner),
            )
            c.executemany(
                "INSERT OR IGNORE INTO lease_chunks (lease_id, hash) VALUES (?, ?)",
                [(lease_id, h) for h in hashes],
            )

    def heartbeat(self, lease_id: str, now: float) -> None:
        with self.db.write(BEST_EFFORT_BUSY_S) as c:
            c.execute("UPDATE leases SET heartbeat = ? WHERE id = ?", (now, lease_id))

    def drop_lease(self, lease_id: str) -> None:
        with self.db.write() as c:
            c.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def _dead_leases(
        self, c: sqlite3.Connection, now: float, owner_alive: Callable[[str], bool | None]
    ) -> tuple[set[str], list[str]]:
        """(ids of dead leases, tokens of owners known gone). `owner_alive(token)` answers from the
        owner's lock (True, False) or cannot tell (None: no owner file); only then does the
        heartbeat decide. No pid is consulted: pids mean nothing across pid namespaces."""
        alive: dict[str, bool | None] = {}
        dead = set()
        for lid, owner, beat in c.execute("SELECT id, owner, heartbeat FROM leases").fetchall():
            if owner not in alive:
                alive[owner] = owner_alive(owner) if owner else None
            if alive[owner] is False or (alive[owner] is None and beat < now - LEASE_TTL_S):
                dead.add(lid)
        return dead, [o for o, a in alive.items() if a is False]

    def lease_owners(self) -> set[str]:
        """Owner tokens of the leases in the index ('' for leases written without one)."""
        return {r[0] for r in self.db.query("SELECT DISTINCT owner FROM leases")}

    # accounting

    def totals(self) -> dict[str, int]:
        with self.db.read() as c:
            n_chunks, stored, raw, unref = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(stored_bytes), 0), COALESCE(SUM(raw_bytes), 0), "
                "COALESCE(SUM(CASE WHEN hash NOT IN (SELECT hash FROM snapshot_chunks) "
                "THEN stored_bytes ELSE 0 END), 0) FROM chunks"
            ).fetchone()
            n_snap, n_pinned = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(pinned), 0) FROM snapshots"
            ).fetchone()
            damaged = c.execute("SELECT COUNT(*) FROM chunks WHERE damaged IS NOT NULL").fetchone()[0]
        return {
            "snapshots": n_snap,
            "pinned": n_pinned,
            "chunks": n_chunks,
            "stored_bytes": stored,
            "raw_bytes": raw,
            "unreferenced_bytes": unref,
            "damaged_chunks": damaged,
        }

    def refcount_errors(self) -> list[str]:
        """Chunks whose refcount disagrees with the snapshots that list them (should be none)."""
        return [
            r[0]
            for r in self.db.query(
                "SELECT c.hash FROM chunks c LEFT JOIN snapshot_chunks sc ON sc.hash = c.hash "
                "GROUP BY c.hash HAVING c.refcount != COUNT(sc.hash)"
            )
        ]

    def malformed(self) -> list[str]:
        """Rows no file or snapshot can follow: chunk rows whose hash is not one, snapshots whose meta
        is not a JSON object."""
        errors = [
            f"chunk row {h!r}: not a chunk hash"
            for (h,) in self.db.query("SELECT hash FROM chunks")
            if not is_hash(h)
        ]
        for sid, meta in self.db.query("SELECT id, meta FROM snapshots"):
            if parse_meta(meta) is BAD_META:
                errors.append(f"snapshot {sid}: meta is not a JSON object")
        return errors

    def dangling_members(self) -> list[str]:
        """Hashes listed by snapshots with no chunk row (foreign keys forbid it; checked anyway)."""
        return [
            r[0]
            for r in self.db.query(
                "SELECT DISTINCT sc.hash FROM snapshot_chunks sc LEFT JOIN chunks c ON c.hash = sc.hash "
                "WHERE c.hash IS NULL"
            )
        ]


_CHUNK_COLS = (
    "hash, fingerprint, chunk_index, parent_hash, n_tokens, codec, stored_bytes, raw_bytes, "
    "refcount, damaged, created, last_used"
)
_PUT_CHUNK = (
    f"INSERT INTO chunks ({_CHUNK_COLS}) VALUES ({','.join('?' * 12)}) "
    "ON CONFLICT(hash) DO UPDATE SET damaged = NULL, codec = excluded.codec, "
    "stored_bytes = excluded.stored_bytes, raw_bytes = excluded.raw_bytes"
)
"""A chunk row for a file just written and checked: one there already is that file's now."""


def _batches(items: Sequence[str]) -> Iterator[Sequence[str]]:
    """Runs of at most _BATCH items: SQLite bounds the parameters of one statement."""
    for i in range(0, len(items), _BATCH):
        yield items[i : i + _BATCH]


def _one_snapshot_view(c: sqlite3.Connection, snapshot_id: str, leased: set[str]) -> PruneInput:
    """What a policy about one snapshot sees: its row, its chunks' rows, and the member lists'
    entries of its chunks (each snapshot listing one, the reference counts `_plan_rm` takes)."""
    snaps = [_snapshot_info(r) for r in c.execute(_snapshot_query("WHERE s.id = ?"), (snapshot_id,))]
    own = [
        r[0]
        for r in c.execute(
            "SELECT hash FROM snapshot_chunks WHERE snapshot_id = ? ORDER BY position", (snapshot_id,)
        )
    ]
    members: dict[str, list[str]] = {snapshot_id: own}
    rows: dict[str, ChunkRow] = {}
    for batch in _batches(own):
        marks = ",".join("?" * len(batch))
        for sid, h in c.execute(
            f"SELECT snapshot_id, hash FROM snapshot_chunks WHERE hash IN ({marks}) AND snapshot_id != ?",
            (*batch, snapshot_id),
        ):
            members.setdefault(sid, []).append(h)
        for r in c.execute(f"SELECT {_CHUNK_COLS} FROM chunks WHERE hash IN ({marks})", batch):
            rows[r[0]] = ChunkRow(*r)
    return PruneInput(snapshots=snaps, members=members, chunks=rows, leased=leased)


def _snapshot_query(where: str = "") -> str:
    return (
        "SELECT s.id, s.label, s.fingerprint, s.n_tokens, s.n_chunks, s.created, s.last_used, s.hits, "
        "s.pinned, s.meta, COALESCE(SUM(c.stored_bytes), 0), COALESCE(SUM(c.raw_bytes), 0) "
        "FROM snapshots s LEFT JOIN snapshot_chunks sc ON sc.snapshot_id = s.id "
        f"LEFT JOIN chunks c ON c.hash = sc.hash {where} GROUP BY s.id"
    )


_REFS = "SELECT COUNT(*) FROM snapshot_chunks sc WHERE sc.hash = chunks.hash"


def _snapshot_info(r: tuple) -> SnapshotInfo:
    return SnapshotInfo(*r[:8], bool(r[8]), dict(parse_meta(r[9])), r[10], r[11])


def _row_values(r: ChunkRow, now: float) -> tuple:
    return (
        r.hash, r.fingerprint, r.index, r.parent_hash, r.n_tokens, r.codec,
        r.stored_bytes, r.raw_bytes, 0, None, now, now,
    )  # fmt: skip
