"""Coordination between processes sharing one store.

- `StoreLock`: an flock on `<root>/lock`. Saves hold it shared from their "is this chunk stored?"
  check until their index commit; removals (prune, rm, orphan sweeps) hold it exclusively. So a
  removal never unlinks a file that a save is about to index, and the kernel drops the lock of a
  killed process by itself. It is opened when first held, so a damaged lock file stops only what
  needs the lock (saves and removals), never a listing, a verify or a restore.
- `LeaseOwner`: the flock that says a process holding leases is alive. Every store object that
  leases gets a random token and holds `<root>/owners/<token>` exclusively while it lives; a removal
  that can take that lock knows the owner is gone (the kernel released it), whatever pid namespace
  either process runs in, and however long the owner's heartbeat has stalled.
- `Heartbeat`: keeps a restore's lease fresh while the restore runs (for leases whose owner file
  cannot be found).
- `LocalCoordination`: the three above as a store on a local directory uses them, with its reserve
  file; `Coordination` is what a store asks of them, which a store on Redis answers otherwise
  (kvflash/storage/redis_store.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

from kvflash.storage.errors import DiskFull, StoreError

T = TypeVar("T")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
LEASE_TTL_S = 120.0
"""A lease whose owner cannot be checked (its owner file is gone) is dead this long after its last
heartbeat. A lease whose owner file exists lives exactly as long as the owner holds its lock, however
late its heartbeat: a stalled process keeps what it reads."""
RESERVE_BYTES = 1 << 20
"""`<root>/reserve`: space held back so that a removal on a full disk can write its index
transaction (a WAL of a few hundred pages for thousands of chunks) and so free the rest."""


class StoreLock:
    def __init__(self, path: Path, read_only: bool = False):
        self.path, self.read_only = path, read_only

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._hold(fcntl.LOCK_SH):
            yield

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._hold(fcntl.LOCK_EX):
            yield

    @contextmanager
    def _hold(self, mode: int) -> Iterator[None]:
        """A fresh open file per holder: flock conflicts between descriptions, so threads of one
        process exclude each other just as processes do."""
        fd = self._open()
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    def _open(self) -> int:
        flags = os.O_RDONLY if self.read_only else os.O_RDWR | os.O_CREAT
        try:
            return os.open(self.path, flags | _NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.ENOTDIR):
                raise StoreError(f"{self.path} is not a plain file (the store's lock); remove it") from None
            raise StoreError(f"cannot open the store's lock {self.path}: {e.strerror}") from None


class LeaseOwner:
    """This store object's token, proven alive to other processes by an flock on its owner file."""

    def __init__(self, owners_dir: Path):
        self.dir = owners_dir
        self.token = secrets.token_hex(8)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def hold(self) -> str:
        """Creates and locks the owner file (once); returns the token to write into leases."""
        with self._lock:
            if self._fd is None:
                try:
                    self.dir.mkdir(exist_ok=True)
                    fd = os.open(self.dir / self.token, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
                except OSError as e:
                    raise StoreError(
                        f"cannot create a lease owner file in {self.dir}: {e.strerror}"
                    ) from None
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd
            return self.token

    def release(self) -> None:
        with self._lock:
            if self._fd is not None:
                (self.dir / self.token).unlink(missing_ok=True)
                os.close(self._fd)
                self._fd = None


def owner_alive(owners_dir: Path, token: str) -> bool | None:
    """True while the owner holds its lock, False once it has gone (its lock is free), None when
    there is no owner file to ask."""
    if not (len(token) == 16 and all(c in "0123456789abcdef" for c in token)):
        return None
    try:
        fd = os.open(owners_dir / token, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


class Heartbeat:
    def __init__(self, beat: Callable[[], None], interval_s: float):
        self._beat = beat
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvflash-lease", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except (StoreError, sqlite3.Error):
                pass  # a busy index delays one beat; the TTL spans several


class Coordination(Protocol):
    """How a store keeps out of the way of the other processes that share it, and what a removal
    needs on a full disk. A local directory does it with flocks and a reserve file; Redis, whose
    scripts check everything they rely on, needs none of them."""

    failed_saves_expire: bool
    """A failed save's files expire by themselves and may be another save's too, so the save leaves
    them (Redis's TTL); otherwise it removes those no index row names."""

    def saving(self) -> AbstractContextManager[None]:
        """Held by a save from its "is this chunk stored?" checks to its index commit."""

    def removing(self) -> AbstractContextManager[None]:
        """Held by a removal: no save is then between writing a chunk and indexing it."""

    def lease_owner(self) -> str:
        """The token this store object writes into its leases."""

    def owner_alive(self, token: str) -> bool | None:
        """Whether a lease's owner still lives; None when this cannot tell (the heartbeat decides)."""

    def after_removal(self, gone_owners: list[str]) -> None:
        """After a removal has committed: the lease owners it found gone."""

    def with_reserve(self, fn: Callable[[], T]) -> T:
        """fn(), and on a full disk fn() again with the room the reserve held."""

    def close(self) -> None: ...


class LocalCoordination:
    """A store directory's: `StoreLock` on `<root>/lock`, a `LeaseOwner` under `<root>/owners` and
    the reserve file `<root>/reserve`."""

    failed_saves_expire = False

    def __init__(self, root: Path, read_only: bool):
        self.lock = StoreLock(root / "lock", read_only)
        self._owners = root / "owners"
        self._owner = LeaseOwner(self._owners)
        self._reserve = root / "reserve"

    def saving(self) -> AbstractContextManager[None]:
        return self.lock.shared()

    def removing(self) -> AbstractContextManager[None]:
        return self.lock.exclusive()

    def lease_owner(self) -> str:
        return self._owner.hold()

    def owner_alive(self, token: str) -> bool | None:
        return owner_alive(self._owners, token)

    def after_removal(self, gone_owners: list[str]) -> None:
        for token in gone_owners:
            (self._owners / token).unlink(missing_ok=True)
        self.make_reserve()

    def with_reserve(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except DiskFull:
            if not self._reserve.is_file():
                raise
            self._reserve.unlink()
            return fn()

    def make_reserve(self) -> None:
        """Best effort: no reserve where there is no room for one."""
        path = self._reserve
        if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
            return
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._owner.release()
