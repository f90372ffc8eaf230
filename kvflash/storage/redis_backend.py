"""Chunk files in Redis: `<prefix>:blob:<hash>` holds exactly the bytes of the chunk file the local
backend would write (docs/FORMAT.md), and `<prefix>:sums:<last hash>` those of a snapshot's summaries
file, so readers check them the same way and a copy between the tiers is a plain copy of bytes.

A blob that no index entry names yet (a save in flight, here or on another server) carries a TTL
(`RedisConfig.unindexed_ttl_s`): the index's commit removes it, and a save killed before its commit
leaves blobs that expire by themselves. So removals only ever delete blobs without a TTL and without
an index row, atomically (a script), and a blob written in a removal's wake survives it. A summaries
file carries that TTL too until the commit of a snapshot of its chain removes it: it is written
persistent only for a snapshot's chain and removed only once no snapshot has that chain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvflash.storage.backend import HeadCheck, ReadBuffer, ReadPlan
from kvflash.storage.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkUnavailable,
    SizeMismatch,
    StoreError,
)
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

_A_CHAIN = """
local chain = false
for _, s in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('LINDEX', ARGV[1]..':members:'..s, -1) == ARGV[2] then chain = true end
end
"""
"""Keys: summaries file, the refs of its chain's last chunk; ARGV: prefix, that hash. Sets `chain`:
whether some snapshot has that chain (its member list ends with the hash)."""

_PUT_SUMS = f"""
{_A_CHAIN}
if chain then return redis.call('SET', KEYS[1], ARGV[3]) end
return redis.call('SET', KEYS[1], ARGV[3], 'EX', ARGV[4])
"""
"""The file of a snapshot's chain is written persistent; any other with the TTL of an uncommitted
save (the commit of its snapshot removes it)."""

_DELETE_SUMS = f"""
{_A_CHAIN}
if chain or redis.call('TTL', KEYS[1]) ~= -1 then return 0 end
return redis.call('DEL', KEYS[1])
"""
"""Only a committed file whose chain is no snapshot's any more."""

_SCAN_BATCH = 1000
T = TypeVar("T")


class RedisBackend:
    def __init__(self, link: RedisLink, keys: Keys):
        self.link, self.keys = link, keys
        self._put = link.client.register_script(_PUT)
        self._delete = link.client.register_script(_DELETE)
        self._put_sums = link.client.register_script(_PUT_SUMS)
        self._delete_sums = link.client.register_script(_DELETE_SUMS)

    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        h = check_hash(chunk_hash)
        data = b"".join(parts)
        ttl = self.link.cfg.unindexed_ttl_s
        self.link.call(lambda c: self._put(keys=[self.keys.blob(h), self.keys.chunk(h)], args=[data, ttl]))

    def _read(self, chunk_hash: str, fn: Callable[[], T]) -> T:
        """fn() for a read: a tier that cannot answer is a chunk it cannot serve now; a chunk it
        refuses keeps its own error."""
        try:
            return fn()
        except ChunkError:
            raise
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
        """One GET, read into `into` (the thread's reused buffer) straight from the socket; a size
        over max_bytes and a header `check` refuses are refused before the rest is read."""
        h = check_hash(chunk_hash)
        buffer = into or ReadBuffer()

        def dest(size: int) -> memoryview:
            if size > max_bytes:
                raise SizeMismatch(h, f"blob of {size} bytes exceeds any valid chunk")
            return buffer.view(size)

        view = self._read(h, lambda: self.link.get_into(self.keys.blob(h), dest, head, check))
        if view is None:
            raise ChunkMissing(h, "not in the shared store (evicted or pruned)")
        return view

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

        size, data = self._read(h, lambda: self.link.call(both))
        if not size:
            raise ChunkMissing(h, "not in the shared store (evicted or pruned)")
        return data, size

    def put_summaries(self, last_hash: str, parts: Sequence[bytes]) -> None:
        h = check_hash(last_hash)
        keys, args = self._sums_keys(h), [self.keys.prefix, h, b"".join(parts), self.link.cfg.unindexed_ttl_s]
        self.link.call(lambda c: self._put_sums(keys=keys, args=args))

    def _sums_keys(self, h: str) -> list[str]:
        return [self.keys.sums(h), f"{self.keys.prefix}:refs:{h}"]

    def get_summaries(self, last_hash: str, head: int, plan: ReadPlan) -> None:
        """Two round trips: the size and the head, then every range the plan asks for (copied into
        its destination: a reply is a buffer of its own)."""
        h = check_hash(last_hash)
        key = self.keys.sums(h)

        def first(c):
            p = c.pipeline(transaction=False)
            p.strlen(key)
            p.getrange(key, 0, head - 1)
            return p.execute()

        size, data = self._read(h, lambda: self.link.call(first))
        if not size:
            raise ChunkMissing(h, "no summaries file in the shared store")
        ranges = [(at, dest) for at, dest in plan(memoryview(data), size) if len(dest)]

        def rest(c):
            p = c.pipeline(transaction=False)
            for at, dest in ranges:
                p.getrange(key, at, at + len(dest) - 1)
            return p.execute()

        parts = self._read(h, lambda: self.link.call(rest)) if ranges else []
        for (_, dest), part in zip(ranges, parts, strict=True):
            if len(part) != len(dest):
                raise ChunkCorrupt(h, "the summaries file changed while it was read")
            dest[:] = part

    def delete_summaries(self, last_hash: str) -> None:
        h = check_hash(last_hash)
        keys, args = self._sums_keys(h), [self.keys.prefix, h]
        self.link.call(lambda c: self._delete_sums(keys=keys, args=args))

    def list_summaries(self) -> Iterator[tuple[str, int]]:
        for h, size, ttl in self._scan(self.keys.all_sums):
            if ttl == -1:
                yield h, size

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

    def _scan(self, pattern: str) -> Iterator[tuple[str, int, int]]:
        """(hash, size, ttl) of every key of the pattern (blobs or summaries files); ttl -1 for a
        committed one."""
        start = len(pattern) - 1
        cursor = 0
        while True:
            cursor, batch = self.link.call(lambda c, at=cursor: c.scan(at, match=pattern, count=_SCAN_BATCH))
            keys = [k.decode() for k in batch]
            keys = [k for k in keys if is_hash(k[start:])]

            def sizes(c, keys=keys):
                p = c.pipeline(transaction=False)
                for k in keys:
                    p.strlen(k)
                    p.ttl(k)
                return p.execute()

            got = self.link.call(sizes) if keys else []
            for i, k in enumerate(keys):
                if got[2 * i]:  # gone since the scan saw it
                    yield k[start:], got[2 * i], got[2 * i + 1]
            if cursor == 0:
                return

    def list_files(self) -> Iterator[tuple[str, int]]:
        for h, size, ttl in self._scan(self.keys.blobs):
            if ttl == -1:
                yield h, size

    def list_temp(self) -> Iterator[tuple[str, int]]:
        """Blobs and summaries files of saves not committed (in flight, or killed): they expire by
        themselves."""
        for kind, pattern in (("blob", self.keys.blobs), ("sums", self.keys.all_sums)):
            for h, size, ttl in self._scan(pattern):
                if ttl != -1:
                    yield f"{kind}:{h}", size

    def sweep_temp(self) -> int:
        """Nothing to sweep: an uncommitted blob expires, and may be a save in flight elsewhere."""
        return 0
