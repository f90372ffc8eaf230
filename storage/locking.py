"""Coordination between processes sharing one store.

- `StoreLock`: an flock on `<root>/lock`. Saves hold it shared from their "is this chunk stored?"
  check until their index commit; removals (prune, rm, orphan sweeps) hold it exclusively. So a
  removal never unlinks a file that a save is about to index, and the kernel drops the lock of a
  killed process by itself.
- `Heartbeat`: keeps a restore's lease fresh while the restore runs.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvflash.storage.errors import StoreError


class StoreLock:
    def __init__(self, path: Path):
        self.path = path
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))

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
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)


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
