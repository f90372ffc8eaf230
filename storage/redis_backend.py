"""Chunk files in Redis: `<prefix>:blob:<hash>` holds exactly the bytes of the chunk file the local
backend would write (docs/FORMAT.md), so readers check them the same way and a copy between the
tiers is a plain copy of bytes.

A blob that no index entry names yet (a save in flight, here or on another server) carries a TTL
(`RedisConfig.unindexed_ttl_s`): the index's commit removes it, and a save killed before its commit
leaves blobs that expire by themselves. So removals only ever delete blobs without a TTL and without
an index row, atomically (a script), and a blob written in a removal's wake survives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from kvflash.storage.backend import HeadCheck, ReadBuffer
from kvflash.storage.errors import ChunkMissing, ChunkUnavailable, SizeMismatch, StoreError
from kvflash.storage.names import check_hash, is_hash
from kvflash.storage.redis_link import Keys, RedisLink

_PUT = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
end
return redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
"""
"""Keys: blob, chunk row. A blob its index row names keeps its state (persistent once committed);
any other is written with the TTL of an uncommitted save."""

_DELETE = """
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('TTL', KEYS[1]) == -1 then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
"""Keys: blob, chunk row. Only a committed blob that no row names any more."""

_SCAN_BATCH = 1000


class RedisBackend:
    def __init__(self, link: RedisLink, keys: Keys):
        self.link, self.keys = link, keys
        self._put = link.client.register_script(_PUT)
        self._delete = link.client.register_script(_DELETE)

    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        h = check_hash(chunk_hash)
        data = b"".join(parts)
        ttl = self.link.cfg.unindexed_ttl_s
        self.link.call(lambda c: self._put(keys=[self.keys.blob(h), self.keys.chunk(h)], args=[data, ttl]))

    def _read(self, chunk_hash: str, fn):
        """fn(client) for a read: a tier that cannot answer is a chunk it cannot serve now."""
        try:
            return self.link.call(fn)
        except StoreError as e:
            raise ChunkUnavailable(chunk_hash, str(e)) from None

    def get(
        self,
        chunk_hash: str,
        max_bytes: int,
        into: ReadBuffer | None = None,
        head: int = 0,
        check: HeadCheck | None = None,
    ) -> memoryview:
        """One GET into the reply's own buffer (`into` is not needed: nothing is copied into it).
        Redis sends a value whole, so the size bound is checked once it has arrived."""
        h = check_hash(chunk_hash)
        data = self._read(h, lambda c: c.get(self.keys.blob(h)))
        if data is None:
            raise ChunkMissing(h, "not in the shared store (evicted or pruned)")
        if len(data) > max_bytes:
            raise SizeMismatch(h, f"blob of {len(data)} bytes exceeds any valid chunk")
        view = memoryview(data)
        if check is not None:
            check(view[:head], len(data))
        return view

    async def aget(
        self, chunk_hash: str, max_bytes: int, head: int = 0, check: HeadCheck | None = None
    ) -> bytes:
        return bytes(await asyncio.to_thread(self.get, chunk_hash, max_bytes, None, head, check))

    def will_need(self, chunk_hashes: Sequence[str]) -> None:
        """Nothing to hint: every read is one round trip already."""

    def get_range(self, chunk_hash: str, start: int, length: int) -> tuple[bytes, int]:
        h = check_hash(chunk_hash)
        key = self.keys.blob(h)

        def both(c):
            p = c.pipeline(transaction=False)
            p.strlen(key)
            p.getrange(key, start, start + length - 1)
            return p.execute()

        size, data = self._read(h, both)
        if not size:
            raise ChunkMissing(h, "not in the shared store (evicted or pruned)")
        return data, size

    def exists(self, chunk_hash: str) -> bool:
        return self.exists_all([chunk_hash])[0]

    def exists_all(self, chunk_hashes: Sequence[str]) -> list[bool]:
        """One round trip for a whole chain."""
        keys = [self.keys.blob(check_hash(h)) for h in chunk_hashes]

        def many(c):
            p = c.pipeline(transaction=False)
            for k in keys:
                p.exists(k)
            return p.execute()

        return [bool(n) for n in self.link.call(many)] if keys else []

    def delete(self, chunk_hash: str) -> None:
        h = check_hash(chunk_hash)
        self.link.call(lambda c: self._delete(keys=[self.keys.blob(h), self.keys.chunk(h)]))

    def _scan(self) -> Iterator[tuple[str, int, int]]:
        """(hash, size, ttl) of every blob; ttl -1 for a committed one."""
        start = len(self.keys.blobs) - 1
        cursor = 0
        while True:
            cursor, batch = self.link.call(
                lambda c, at=cursor: c.scan(at, match=self.keys.blobs, count=_SCAN_BATCH)
            )
            names = [k.decode()[start:] for k in batch]
            names = [h for h in names if is_hash(h)]

            def sizes(c, names=names):
                p = c.pipeline(transaction=False)
                for h in names:
                    p.strlen(self.keys.blob(h))
                    p.ttl(self.keys.blob(h))
                return p.execute()

            got = self.link.call(sizes) if names else []
            for i, h in enumerate(names):
                if got[2 * i]:  # gone since the scan saw it
                    yield h, got[2 * i], got[2 * i + 1]
            if cursor == 0:
                return

    def list_files(self) -> Iterator[tuple[str, int]]:
        for h, size, ttl in self._scan():
            if ttl == -1:
                yield h, size

    def list_temp(self) -> Iterator[tuple[str, int]]:
        """Blobs of saves not committed (in flight, or killed): they expire by themselves."""
        for h, size, ttl in self._scan():
            if ttl != -1:
                yield f"blob:{h}", size

    def sweep_temp(self) -> int:
        """Nothing to sweep: an uncommitted blob expires, and may be a save in flight elsewhere."""
        return 0
