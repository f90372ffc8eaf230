"""The SQLite file under a store's index: its schema and migrations, the one connection a store's
threads share, and its transactions.

WAL mode lets many processes read while one writes; writes take the lock up front (`BEGIN IMMEDIATE`)
and wait out a busy one. `synchronous=FULL` because a prune commits row deletions before it unlinks
files: a commit lost to a power cut would leave rows naming deleted files.

Opening writes nothing unless the schema is older than this code's, so a store on a full disk or a
read-only one still opens; a read-only one is opened read-only (`read_only`), and a file that is not
a database, or whose pages SQLite's quick check finds damaged (one pass over the file: 0.1 s for an
index of 200,000 chunks), raises `IndexDamaged` (the store then rebuilds the index from its chunk
files). Damage met after opening raises `IndexDamaged` too, from the statement that met it.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvflash.storage.errors import DiskFull, StoreError

SCHEMA_VERSION = 2
"""2: leases name their owner (a random token per store object, docs/FORMAT.md: Leases)."""
BUSY_TIMEOUT_S = 60.0
WRITE_POLL_S = 0.02
"""How often a write waiting for another process's write lock tries again (`IndexDb._begun`)."""

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


class IndexDamaged(StoreError):
    """The index file is not a readable SQLite database."""


class IndexDb:
    """One connection, shared by the threads of a store under `lock`."""

    def __init__(self, path: Path | str, read_only: bool = False):
        self.path, self.read_only = path, read_only
        self.lock = threading.RLock()
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
        if (found := c.execute("PRAGMA quick_check(1)").fetchone()[0]) != "ok":
            # damage past the first page, which user_version alone does not read
            raise IndexDamaged(f"index {self.path} is damaged: {' '.join(found.split())}")
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
        with self.write() as w:
            version = w.execute("PRAGMA user_version").fetchone()[0]
            if version == 1:
                w.execute("ALTER TABLE leases ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
            for stmt in _SCHEMA:
                w.execute(stmt)
            w.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def checkpoint(self) -> None:
        """Moves the WAL's pages into the database file and empties the WAL (a file about to be
        renamed must hold everything itself)."""
        with self.lock, _store_errors(self.path):
            busy = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        if busy:
            raise StoreError(f"the index {self.path} is in use: its WAL cannot be emptied")

    @contextmanager
    def write(self, busy_s: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction; `busy_s` bounds the wait for another writer (best-effort writes
        give up sooner than BUSY_TIMEOUT_S)."""
        if self.read_only:
            raise StoreError(f"the index {self.path} is read-only")
        with _store_errors(self.path), self._begun(BUSY_TIMEOUT_S if busy_s is None else busy_s):
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
            with self.lock:
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
    def read(self) -> Iterator[sqlite3.Connection]:
        """One consistent view across several statements."""
        with self.lock, _store_errors(self.path):
            self.conn.execute("BEGIN")
            try:
                yield self.conn
            finally:
                self.conn.execute("COMMIT")

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """One statement's rows."""
        with self.lock, _store_errors(self.path):
            return self.conn.execute(sql, params).fetchall()


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
    if _damaged(e):
        return IndexDamaged(f"index {path} is damaged: {e}")
    if code == sqlite3.SQLITE_FULL or (
        code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and _full(path)
    ):
        return DiskFull(f"no space left for the snapshot index {path}: {e}")
    return StoreError(f"cannot open the index {path}: {e}")


def _damaged(e: sqlite3.DatabaseError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT) or "not a database" in str(e)


@contextmanager
def _store_errors(path: Path | str) -> Iterator[None]:
    """A full disk as `DiskFull` and a damaged file as `IndexDamaged` (which the next open of the
    store sets aside and rebuilds), where SQLite raises them mid-statement."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e):
            raise DiskFull(f"no space left for the snapshot index: {e}") from e
        if _damaged(e):
            raise IndexDamaged(f"index {path} is damaged: {e}; the store's next open rebuilds it") from e
        raise
