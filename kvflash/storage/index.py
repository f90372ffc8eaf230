"""The SQLite index of a store: schema and every query.

WAL mode lets many processes read while one writes; writes take the lock up front (`BEGIN IMMEDIATE`)
and wait out a busy one. `synchronous=FULL` because a prune commits row deletions before it unlinks
files: a commit lost to a power cut would leave rows naming deleted files.

Opening writes nothing unless the schema is older than this code's, so a store on a full disk or a
read-only one still opens; a read-only one is opened read-only (`read_only`), and a file that is not
a database raises `IndexDamaged` (the store then rebuilds the index from its chunk files).
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvflash.storage.errors import ChunkCorrupt, ChunkMissing, DiskFull, SnapshotNotFound, StoreError
from kvflash.storage.names import is_hash, new_snapshot_id

if TYPE_CHECKING:
    from kvflash.storage.format import ChunkHeader

SCHEMA_VERSION = 2
"""2: leases name their owner (a random token per store object, docs/FORMAT.md: Leases)."""
BUSY_TIMEOUT_S = 60.0
LEASE_TTL_S = 120.0
"""A lease whose owner cannot be checked (its owner file is gone) is dead this long after its last
heartbeat. A lease whose owner file exists lives exactly as long as the owner holds its lock, however
late its heartbeat: a stalled process keeps what it reads."""
BEST_EFFORT_BUSY_S = 5.0
"""How long bookkeeping a restore can do without (a lease, a hit, a damage mark) waits for a busy
index before it gives up: the answer does not wait a minute for a writer that holds the index."""
WRITE_POLL_S = 0.02
"""How often a write waiting for another process's write lock tries again (`Index._begun`)."""
_BATCH = 500
"""Hashes per `IN (...)` query, under SQLite's bound-variable limit."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS chunks (
        hash TEXT PRIMARY KEY,
        fingerprint TEXT NOT NULL,
        chunk_index INTEGER NOT NULL,
        parent_hash TEXT NOT NULL,
        n_tokens INTEGER NOT NULL,
        codec TEXT NOT NULL,
        stored_bytes INTEGER NOT NULL,
        raw_bytes INTEGER NOT NULL,
        refcount INTEGER NOT NULL DEFAULT 0,
        damaged TEXT,
        created REAL NOT NULL,
        last_used REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS snapshots (
        id TEXT PRIMARY KEY,
        label TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        n_tokens INTEGER NOT NULL,
        n_chunks INTEGER NOT NULL,
        created REAL NOT NULL,
        last_used REAL NOT NULL,
        hits INTEGER NOT NULL DEFAULT 0,
        pinned INTEGER NOT NULL DEFAULT 0,
        meta TEXT NOT NULL DEFAULT '{}')""",
    """CREATE TABLE IF NOT EXISTS snapshot_chunks (
        snapshot_id TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        hash TEXT NOT NULL REFERENCES chunks(hash),
        PRIMARY KEY (snapshot_id, position))""",
    "CREATE INDEX IF NOT EXISTS snapshot_chunks_by_hash ON snapshot_chunks(hash)",
    """CREATE TRIGGER IF NOT EXISTS chunk_ref_up AFTER INSERT ON snapshot_chunks BEGIN
        UPDATE chunks SET refcount = refcount + 1 WHERE hash = NEW.hash; END""",
    """CREATE TRIGGER IF NOT EXISTS chunk_ref_down AFTER DELETE ON snapshot_chunks BEGIN
        UPDATE chunks SET refcount = refcount - 1 WHERE hash = OLD.hash; END""",
    """CREATE TABLE IF NOT EXISTS leases (
        id TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        host TEXT NOT NULL,
        heartbeat REAL NOT NULL,
        owner TEXT NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS lease_chunks (
        lease_id TEXT NOT NULL REFERENCES leases(id) ON DELETE CASCADE,
        hash TEXT NOT NULL,
        PRIMARY KEY (lease_id, hash))""",
    "CREATE INDEX IF NOT EXISTS lease_chunks_by_hash ON lease_chunks(hash)",
)


@dataclass(frozen=True)
class ChunkRow:
    hash: str
    fingerprint: str
    index: int
    parent_hash: str
    n_tokens: int
    codec: str
    stored_bytes: int
    """The chunk file's size."""
    raw_bytes: int
    """The uncompressed KV's size."""
    refcount: int = 0
    damaged: str | None = None
    created: float = 0.0
    last_used: float = 0.0

    @classmethod
    def of(cls, h: ChunkHeader) -> ChunkRow:
        """The row of a chunk file, from its (parsed, size-checked) header."""
        return cls(
            h.chain_hash, h.fingerprint, h.index, h.parent_hash, h.n_tokens,
            h.codec.name.lower(), h.file_len, h.kv_bytes,
        )  # fmt: skip


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    label: str
    fingerprint: str
    n_tokens: int
    n_chunks: int
    created: float
    last_used: float
    hits: int
    pinned: bool
    meta: dict
    stored_bytes: int
    """Bytes of its chunk files, shared chunks counted in full."""
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 0.0


@dataclass(frozen=True)
class Snapshot(SnapshotInfo):
    chunk_hashes: tuple[str, ...] = ()


@dataclass
class PruneInput:
    """What a prune policy sees, read inside the transaction that applies its decision."""

    snapshots: list[SnapshotInfo]
    members: dict[str, list[str]]
    """snapshot id -> its chunk hashes."""
    chunks: dict[str, ChunkRow]
    leased: set[str]


@dataclass
class PruneDecision:
    snapshots: list[str] = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)
    """Chunks left unreferenced and unleased once those snapshots are gone."""
    gone_owners: list[str] = field(default_factory=list)
    """Lease owners found gone: their owner files are the caller's to remove."""


class IndexDamaged(StoreError):
    """The index file is not a readable SQLite database."""


class Index:
    def __init__(self, path: Path | str, read_only: bool = False):
        self.path, self.read_only = path, read_only
        self._lock = threading.RLock()
        try:
            self.conn = _connect(path, read_only)
        except sqlite3.DatabaseError as e:
            raise _damage(path, e) from e
        try:
            self._init_schema()
        except sqlite3.DatabaseError as e:
            self.conn.close()
            raise _damage(path, e) from e
        except BaseException:
            self.conn.close()
            raise

    def _init_schema(self) -> None:
        c = self.conn
        c.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        version = c.execute("PRAGMA user_version").fetchone()[0]  # reads the file: NOTADB shows here
        if version > SCHEMA_VERSION:
            raise StoreError(f"index {self.path} has schema {version}; this kvflash knows {SCHEMA_VERSION}")
        if self.read_only:
            if version < SCHEMA_VERSION:
                raise StoreError(f"index {self.path} has schema {version} and the store is read-only")
            return
        if c.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            c.execute("PRAGMA journal_mode = WAL")
        c.execute("PRAGMA synchronous = FULL")
        c.execute("PRAGMA foreign_keys = ON")
        if version == SCHEMA_VERSION:
            return  # nothing to write: a full disk does not stop a store from opening
        with self._write() as w:
            version = w.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                w.execute("ALTER TABLE leases ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            for stmt in _SCHEMA:
                w.execute(stmt)
            w.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def size_bytes(self) -> int:
        """Bytes of the index's files: the database, its WAL and its shared memory."""
        files = [Path(f"{self.path}{s}") for s in ("", "-wal", "-shm")]
        return sum(f.stat().st_size for f in files if f.exists())

    @contextmanager
    def _write(self, busy_s: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction; `busy_s` bounds the wait for another writer (best-effort writes
        give up sooner than BUSY_TIMEOUT_S)."""
        if self.read_only:
            raise StoreError(f"the index {self.path} is read-only")
        with _disk_full_as_error(), self._begun(BUSY_TIMEOUT_S if busy_s is None else busy_s):
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise

    @contextmanager
    def _begun(self, wait_s: float) -> Iterator[None]:
        """Holds the connection with a write transaction begun. While another process holds the
        write lock, `BEGIN IMMEDIATE` is tried again every WRITE_POLL_S for up to wait_s, with the
        connection let go in between: this store's reads (a restore's lookup) and best-effort
        writes never queue behind a save that waits for the lock."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                self.conn.execute("PRAGMA busy_timeout = 0")
                try:
                    self.conn.execute("BEGIN IMMEDIATE")
                    begun = True
                except sqlite3.OperationalError as e:
                    if (
                        getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY
                        or time.monotonic() > deadline
                    ):
                        raise
                    begun = False
                finally:
                    self.conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                if begun:
                    yield
                    return
            time.sleep(WRITE_POLL_S)

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One consistent view across several statements."""
        with self._lock:
            self.conn.execute("BEGIN")
            try:
                yield self.conn
            finally:
                self.conn.execute("COMMIT")

    # chunks

    def chunk_rows(self, hashes: Iterable[str]) -> dict[str, ChunkRow]:
        out: dict[str, ChunkRow] = {}
        hashes = list(hashes)
        with self._read() as c:
            for i in range(0, len(hashes), _BATCH):
                batch = hashes[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                for r in c.execute(f"SELECT {_CHUNK_COLS} FROM chunks WHERE hash IN ({marks})", batch):
                    out[r[0]] = ChunkRow(*r)
        return out

    def intact(self, hashes: Sequence[str], fingerprint: str) -> set[str]:
        """Which of hashes are indexed under fingerprint and not marked damaged (as `chunk_rows`
        would say), without building their rows: a lookup asks it of a whole prompt's chunks."""
        out: set[str] = set()
        with self._read() as c:
            for i in range(0, len(hashes), _BATCH):
                batch = hashes[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                query = (
                    f"SELECT hash FROM chunks WHERE hash IN ({marks}) AND fingerprint = ? "
                    "AND (damaged IS NULL OR damaged = '')"
                )
                out.update(r[0] for r in c.execute(query, (*batch, fingerprint)))
        return out

    def all_chunk_rows(self) -> dict[str, ChunkRow]:
        with self._lock:
            return {r[0]: ChunkRow(*r) for r in self.conn.execute(f"SELECT {_CHUNK_COLS} FROM chunks")}

    def mark_damaged(self, chunk_hash: str, reason: str | None) -> None:
        """A damaged chunk is no longer offered as a prefix, and the next save of it rewrites it.
        None clears the mark (verify found the file intact)."""
        with self._write(BEST_EFFORT_BUSY_S) as c:
            c.execute("UPDATE chunks SET damaged = ? WHERE hash = ?", (reason and reason[:500], chunk_hash))

    def record_hit(self, hashes: list[str], now: float) -> None:
        """A committed restore: its chunks and every snapshot ending a shared prefix there move up."""
        with self._write(BEST_EFFORT_BUSY_S) as c:
            for i in range(0, len(hashes), _BATCH):
                batch = hashes[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                c.execute(f"UPDATE chunks SET last_used = ? WHERE hash IN ({marks})", (now, *batch))
            c.execute(
                "UPDATE snapshots SET hits = hits + 1, last_used = ? WHERE id IN "
                "(SELECT snapshot_id FROM snapshot_chunks WHERE hash = ? AND position = ?)",
                (now, hashes[-1], len(hashes) - 1),
            )

    def add_chunk_rows(self, rows: list[ChunkRow], now: float) -> None:
        """Rows of files already durable, referenced by no snapshot yet (an index being rebuilt)."""
        with self._write() as c:
            c.executemany(
                f"INSERT OR IGNORE INTO chunks ({_CHUNK_COLS}) VALUES ({','.join('?' * 12)})",
                [_row_values(r, now) for r in rows],
            )

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
        with self._write() as c:
            taken = "SELECT 1 FROM snapshots WHERE id = ?"
            if snapshot_id and c.execute(taken, (snapshot_id,)).fetchone():
                return snapshot_id
            c.executemany(
                f"INSERT INTO chunks ({_CHUNK_COLS}) VALUES ({','.join('?' * 12)}) "
                "ON CONFLICT(hash) DO UPDATE SET damaged = NULL, codec = excluded.codec, "
                "stored_bytes = excluded.stored_bytes, raw_bytes = excluded.raw_bytes",
                [_row_values(r, now) for r in new_rows],
            )
            for i in range(0, len(hashes), _BATCH):
                batch = hashes[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                found = {r[0] for r in c.execute(f"SELECT hash FROM chunks WHERE hash IN ({marks})", batch)}
                if missing := [h for h in batch if h not in found]:
                    raise ChunkMissing(missing[0], "referenced by the new snapshot but not stored")
            taken = "SELECT 1 FROM snapshots WHERE id = ?"
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
        with self._lock:
            return [_snapshot_info(r) for r in self.conn.execute(_snapshot_query() + " ORDER BY s.created")]

    def snapshot(self, snapshot_id: str) -> Snapshot:
        with self._read() as c:
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
        with self._lock:
            return [
                r[0]
                for r in self.conn.execute(
                    "SELECT last.hash FROM snapshot_chunks sc JOIN snapshots s ON s.id = sc.snapshot_id "
                    "JOIN snapshot_chunks last ON last.snapshot_id = s.id AND last.position = s.n_chunks - 1 "
                    "WHERE sc.hash = ? AND sc.position = ? GROUP BY last.hash ORDER BY MIN(s.n_chunks)",
                    (chunk_hash, position),
                )
            ]

    def chain_ends(self) -> set[str]:
        """The last chunk of every snapshot's chain: what names its summaries file."""
        with self._lock:
            return {
                r[0]
                for r in self.conn.execute(
                    "SELECT sc.hash FROM snapshot_chunks sc JOIN snapshots s ON s.id = sc.snapshot_id "
                    "AND sc.position = s.n_chunks - 1"
                )
            }

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        with self._write() as c:
            n = c.execute("UPDATE snapshots SET pinned = ? WHERE id = ?", (int(pinned), snapshot_id)).rowcount
            if not n:
                raise SnapshotNotFound(f"no snapshot {snapshot_id}")

    def members(self) -> dict[str, list[str]]:
        with self._lock:
            out: dict[str, list[str]] = {}
            for sid, h in self.conn.execute(
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
    ) -> PruneDecision:
        """Runs a removal policy on a consistent view and applies it in the same transaction, so no
        lease or save can slip in between the decision and the deletion. Files are the caller's to
        unlink after this returns; a crash in between leaves orphan files, never dangling rows.

        The snapshots' member lists are the truth about references: refcounts that disagree with
        them are recomputed first, and no chunk a snapshot lists is deleted whatever its refcount."""
        with self._read() if dry_run else self._write() as c:
            dead, gone = self._dead_leases(c, now, owner_alive)
            if not dry_run:
                c.executemany("DELETE FROM leases WHERE id = ?", [(lid,) for lid in dead])
            leased = {h for lid, h in c.execute("SELECT lease_id, hash FROM lease_chunks") if lid not in dead}
            decision = decide(
                PruneInput(
                    snapshots=[_snapshot_info(r) for r in c.execute(_snapshot_query())],
                    members=self.members(),
                    chunks=self.all_chunk_rows(),
                    leased=leased,
                )
            )
            decision.gone_owners = gone
            if not dry_run:
                c.execute(f"UPDATE chunks SET refcount = ({_REFS}) WHERE refcount != ({_REFS})")
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
        with self._write(BEST_EFFORT_BUSY_S) as c:
            for i in range(0, len(hashes), _BATCH):
                batch = hashes[i : i + _BATCH]
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
        with self._write(BEST_EFFORT_BUSY_S) as c:
            c.execute("UPDATE leases SET heartbeat = ? WHERE id = ?", (now, lease_id))

    def drop_lease(self, lease_id: str) -> None:
        with self._write() as c:
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
        with self._lock:
            return {r[0] for r in self.conn.execute("SELECT DISTINCT owner FROM leases")}

    # accounting

    def totals(self) -> dict[str, int]:
        with self._read() as c:
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
        with self._lock:
            return [
                r[0]
                for r in self.conn.execute(
                    "SELECT c.hash FROM chunks c LEFT JOIN snapshot_chunks sc ON sc.hash = c.hash "
                    "GROUP BY c.hash HAVING c.refcount != COUNT(sc.hash)"
                )
            ]

    def malformed(self) -> list[str]:
        """Rows no file or snapshot can follow: chunk rows whose hash is not one, snapshots whose meta
        is not a JSON object."""
        with self._lock:
            errors = [
                f"chunk row {h!r}: not a chunk hash"
                for (h,) in self.conn.execute("SELECT hash FROM chunks")
                if not is_hash(h)
            ]
            for sid, meta in self.conn.execute("SELECT id, meta FROM snapshots"):
                if parse_meta(meta) is BAD_META:
                    errors.append(f"snapshot {sid}: meta is not a JSON object")
            return errors

    def dangling_members(self) -> list[str]:
        """Hashes listed by snapshots with no chunk row (foreign keys forbid it; checked anyway)."""
        with self._lock:
            return [
                r[0]
                for r in self.conn.execute(
                    "SELECT DISTINCT sc.hash FROM snapshot_chunks sc LEFT JOIN chunks c ON c.hash = sc.hash "
                    "WHERE c.hash IS NULL"
                )
            ]


_CHUNK_COLS = (
    "hash, fingerprint, chunk_index, parent_hash, n_tokens, codec, stored_bytes, raw_bytes, "
    "refcount, damaged, created, last_used"
)


def _snapshot_query(where: str = "") -> str:
    return (
        "SELECT s.id, s.label, s.fingerprint, s.n_tokens, s.n_chunks, s.created, s.last_used, s.hits, "
        "s.pinned, s.meta, COALESCE(SUM(c.stored_bytes), 0), COALESCE(SUM(c.raw_bytes), 0) "
        "FROM snapshots s LEFT JOIN snapshot_chunks sc ON sc.snapshot_id = s.id "
        f"LEFT JOIN chunks c ON c.hash = sc.hash {where} GROUP BY s.id"
    )


_REFS = "SELECT COUNT(*) FROM snapshot_chunks sc WHERE sc.hash = chunks.hash"
BAD_META: dict = {}
"""What a snapshot's meta reads as when the index holds no JSON object there (`malformed` names it)."""


def parse_meta(text: object) -> dict:
    try:
        meta = json.loads(text) if isinstance(text, str | bytes) else None
    except ValueError:
        return BAD_META
    return meta if isinstance(meta, dict) else BAD_META


def _snapshot_info(r: tuple) -> SnapshotInfo:
    return SnapshotInfo(*r[:8], bool(r[8]), dict(parse_meta(r[9])), r[10], r[11])


def _row_values(r: ChunkRow, now: float) -> tuple:
    return (
        r.hash, r.fingerprint, r.index, r.parent_hash, r.n_tokens, r.codec,
        r.stored_bytes, r.raw_bytes, 0, None, now, now,
    )  # fmt: skip


def _connect(path: Path | str, read_only: bool) -> sqlite3.Connection:
    """A read-only store is opened `mode=ro`; where SQLite cannot make its shared-memory file there
    (a read-only file system), `immutable=1`: nobody can write such a store."""
    kw = dict(timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    if not read_only:
        return sqlite3.connect(path, **kw)
    uri = Path(path).resolve().as_uri()
    try:
        conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, **kw)
        conn.execute("PRAGMA user_version").fetchone()
        return conn
    except sqlite3.OperationalError:
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, **kw)


def _full(path: Path | str) -> bool:
    """Whether the index's file system has no block left (SQLite reports a shared-memory file it
    could not extend as an I/O error)."""
    try:
        return os.statvfs(Path(path).parent).f_bavail == 0
    except OSError:
        return False


def _damage(path: Path | str, e: sqlite3.DatabaseError) -> StoreError:
    code = getattr(e, "sqlite_errorcode", None)
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) or "not a database" in str(e):
        return IndexDamaged(f"index {path} is damaged: {e}")
    if code == sqlite3.SQLITE_FULL or (
        code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and _full(path)
    ):
        return DiskFull(f"no space left for the snapshot index {path}: {e}")
    return StoreError(f"cannot open the index {path}: {e}")


@contextmanager
def _disk_full_as_error() -> Iterator[None]:
    try:
        yield
    except sqlite3.OperationalError as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e):
            raise DiskFull(f"no space left for the snapshot index: {e}") from e
        raise
