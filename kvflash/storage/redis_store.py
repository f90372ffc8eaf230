"""A snapshot store whose chunks and index live in Redis, shared by every server that names it.

It is a `SnapshotStore` (the same saving, reading, checking, leasing and removal code) over a
`RedisBackend` and a `RedisIndex`; what a local store does with files and flocks it does so:
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
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

from kvflash.storage.codec import DEFAULT_LEVEL
from kvflash.storage.index import PruneDecision
from kvflash.storage.redis_backend import RedisBackend
from kvflash.storage.redis_index import RedisIndex
from kvflash.storage.redis_link import Keys, RedisConfig, RedisLink
from kvflash.storage.store import SnapshotStore, _check_codec


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
        _check_codec(codec, level)
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
        self.backend = RedisBackend(self.link, keys)
        self.index = RedisIndex(self.link, keys)
        self.read_only = False
        self._token = secrets.token_hex(8)
        self._start(codec, level, workers)

    def close(self) -> None:
        self.pool.shutdown()
        self._hints.shutdown(cancel_futures=True)
        self.link.close()

    def _saving(self) -> AbstractContextManager:
        return nullcontext()

    def _removing(self) -> AbstractContextManager:
        return nullcontext()

    def _remove_unindexed(self, hashes: list[str], summaries: Sequence[str] = ()) -> None:
        """Nothing: a failed save's blobs and summaries file carry their TTL, and may be another
        save's too."""

    def _lease_owner(self) -> str:
        return self._token

    def _owner_alive(self, token: str) -> bool | None:
        return None

    def _after_removal(self, decision: PruneDecision) -> None:
        pass

    def _with_reserve(self, fn):
        return fn()

    def _index_bytes(self) -> int:
        """Redis's own count (MEMORY USAGE) of every key of the store but the blobs."""
        return self.index.memory_usage()
