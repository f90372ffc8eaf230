"""A snapshot store whose chunks and index live in Redis, shared by every server that names it.

It is a `SnapshotStore` (the same saving, reading, checking, leasing and removal code) over a
`RedisBackend`, a `RedisIndex` and a `RedisCoordination`; what a local store does with files and
flocks it does so:
- a save needs no lock: its blobs are written with a TTL and its index commit is one script that
  checks they are all still there (kvflash/storage/redis_backend.py,
  kvflash/storage/redis_index.py);
- a removal needs no lock: its script keeps whatever became pinned, leased or listed since it
  decided, and only committed blobs that no row names are deleted;
- a lease lives while its heartbeat does (`LEASE_TTL_S` on Redis's clock): its owner may be on
  another machine, whose locks no other server can see.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

from kvflash.storage.codec import DEFAULT_LEVEL
from kvflash.storage.redis_backend import RedisBackend
from kvflash.storage.redis_index import RedisIndex
from kvflash.storage.redis_link import Keys, RedisConfig, RedisLink
from kvflash.storage.snapshot_writer import check_codec
from kvflash.storage.store import SnapshotStore

T = TypeVar("T")


class RedisStore(SnapshotStore):
    def __init__(
        self,
        url: str | RedisConfig,
        codec: str = "lossless",
        level: int = DEFAULT_LEVEL,
        workers: int | None = None,
        check: bool = True,
    ):
        """`check` makes one round trip first, so a wrong password or URL raises here; without it
        (a server that should come up before Redis does) the first use says so instead."""
        check_codec(codec, level)
        self.cfg = url if isinstance(url, RedisConfig) else RedisConfig(url)
        self.link = RedisLink(self.cfg)
        self.where = self.link.where
        self.root = None
        if check:
            try:
                self.link.check()
            except BaseException:
                self.link.close()
                raise
        keys = Keys(self.cfg.prefix)
        backend, index = RedisBackend(self.link, keys), RedisIndex(self.link, keys)
        self._assemble(backend, index, RedisCoordination(), False, codec, level, workers)

    def close(self) -> None:
        super().close()
        self.link.close()


class RedisCoordination:
    """A shared tier's `Coordination` (kvflash/storage/locking.py): its scripts keep saves and
    removals apart, so there is no lock to hold, and a lease's owner may be on another machine, so
    the lease lives by its heartbeat alone."""

    failed_saves_expire = True

    def __init__(self) -> None:
        self._token = secrets.token_hex(8)

    def saving(self) -> AbstractContextManager[None]:
        return nullcontext()

    def removing(self) -> AbstractContextManager[None]:
        return nullcontext()

    def lease_owner(self) -> str:
        return self._token

    def owner_alive(self, token: str) -> bool | None:
        return None

    def after_removal(self, gone_owners: list[str]) -> None:
        pass

    def with_reserve(self, fn: Callable[[], T]) -> T:
        return fn()

    def close(self) -> None:
        pass
