"""The snapshot index of a shared tier, in Redis: the same records as the SQLite index
(kvflash/storage/index.py), kept so that several servers can write them at once.

Every change is one Lua script: Redis runs a script whole or not at all, before or after any other
client's command, and its append-only file keeps it as one transaction. So two servers saving the
same document store each chunk once and each snapshot whole, and a script checks everything it relies
on (the blobs it names exist, a chunk is neither leased nor listed) before it writes anything.
References are sets of snapshot ids per chunk, so nothing is ever counted twice.

Keys under the store's prefix `p` (docs/FORMAT.md: Shared tier):

    p:chunk:<h>      hash: the chunk row      p:refs:<h>     set: ids of snapshots listing it
    p:snap:<id>      hash: the snapshot row   p:members:<id> list: its chunk hashes in order
    p:snaps, p:chunks  sets of every id, every hash
    p:lease:<id>     set: the chunks a restore in flight reads (expires with its heartbeat)
    p:leases         sorted set: lease id -> expiry (ms, Redis's clock)

A Redis that evicts (maxmemory) may drop any of these keys: a reader takes a snapshot whose row or
member list is gone, or shorter than it says, as absent, and a chunk whose row or blob is gone as not
stored. Lookups go by chunk (content addressing), so they stop at the first missing one: a miss,
never a half-restored prefix.

The scripts and the `RedisIndex` that runs them are one module: a script's ARGV positions are fixed
by the call that passes them, so a change to one is a change to both.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

from kvflash.storage.errors import ChunkCorrupt, ChunkMissing, SnapshotNotFound, StoreError
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
from kvflash.storage.redis_link import Keys, RedisLink

_NOW_MS = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"

_ADD_SNAPSHOT = """
local p, sid = ARGV[1], ARGV[2]
local rows, hashes = cjson.decode(ARGV[10]), cjson.decode(ARGV[11])
if redis.call('EXISTS', p..':snap:'..sid) == 1 then
  if ARGV[3] == '1' then
    redis.call('PERSIST', p..':sums:'..hashes[#hashes])
    return {'ok', sid}
  end
  return {'taken', sid}
end
local new = {}
for _, r in ipairs(rows) do new[r[1]] = r end
for _, h in ipairs(hashes) do
  if redis.call('EXISTS', p..':blob:'..h) == 0 then return {'missing', h} end
  if new[h] == nil and redis.call('EXISTS', p..':chunk:'..h) == 0 then return {'missing', h} end
end
local now = ARGV[8]
for _, r in ipairs(rows) do
  local k = p..':chunk:'..r[1]
  if redis.call('EXISTS', k) == 0 then
    redis.call('HSET', k, 'fingerprint', r[2], 'index', r[3], 'parent', r[4], 'n_tokens', r[5],
      'created', now, 'last_used', now)
  end
  redis.call('HSET', k, 'codec', r[6], 'stored', r[7], 'raw', r[8])
  redis.call('HDEL', k, 'damaged')
  redis.call('SADD', p..':chunks', r[1])
end
local hits = 0
for _, s in ipairs(cjson.decode(ARGV[9])) do
  hits = hits + tonumber(redis.call('HGET', p..':snap:'..s, 'hits') or '0')
end
local stored, raw = 0, 0
for _, h in ipairs(hashes) do
  redis.call('PERSIST', p..':blob:'..h)
  local c = redis.call('HMGET', p..':chunk:'..h, 'stored', 'raw')
  stored, raw = stored + tonumber(c[1]), raw + tonumber(c[2])
  redis.call('RPUSH', p..':members:'..sid, h)
  redis.call('SADD', p..':refs:'..h, sid)
end
redis.call('HSET', p..':snap:'..sid, 'label', ARGV[4], 'fingerprint', ARGV[5], 'n_tokens', ARGV[6],
  'n_chunks', #hashes, 'created', now, 'last_used', now, 'hits', hits, 'pinned', 0, 'meta', ARGV[7],
  'stored', stored, 'raw', raw)
redis.call('SADD', p..':snaps', sid)
redis.call('PERSIST', p..':sums:'..hashes[#hashes])
return {'ok', sid}
"""
"""A new snapshot, its new chunk rows (blobs already written) and its members, or nothing: 'missing'
names a chunk whose blob or row is gone, 'taken' an id in use. With ARGV[3] = '1' (a copy from
another tier keeps its id) an id already present is the same snapshot, copied before. Either way
the summaries file of its chain, if written, is committed (its TTL removed)."""

_CHAINS_THROUGH = """
local p, h, at = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for _, s in ipairs(redis.call('SMEMBERS', p..':refs:'..h)) do
  local m = p..':members:'..s
  if redis.call('LINDEX', m, at) == h then
    table.insert(out, {redis.call('LINDEX', m, -1), redis.call('LLEN', m)})
  end
end
return out
"""
"""(last chunk, length) of every snapshot whose chain holds chunk ARGV[2] at position ARGV[3]."""

_LEASED = f"""
{_NOW_MS}
for _, l in ipairs(redis.call('ZRANGEBYSCORE', p..':leases', '-inf', now)) do
  redis.call('DEL', p..':lease:'..l)
end
redis.call('ZREMRANGEBYSCORE', p..':leases', '-inf', now)
local leased = {{}}
for _, l in ipairs(redis.call('ZRANGE', p..':leases', 0, -1)) do
  for _, h in ipairs(redis.call('SMEMBERS', p..':lease:'..l)) do leased[h] = true end
end
"""
"""Reaps expired leases and sets `leased`: what live ones hold."""

_REMOVE = f"""
local p = ARGV[1]
{_LEASED}
local gone_s, gone_c = {{}}, {{}}
for _, s in ipairs(cjson.decode(ARGV[2])) do
  local members = redis.call('LRANGE', p..':members:'..s, 0, -1)
  local keep = redis.call('HGET', p..':snap:'..s, 'pinned') == '1'
  for _, h in ipairs(members) do if leased[h] then keep = true end end
  if not keep then
    for _, h in ipairs(members) do redis.call('SREM', p..':refs:'..h, s) end
    redis.call('DEL', p..':snap:'..s, p..':members:'..s)
    redis.call('SREM', p..':snaps', s)
    table.insert(gone_s, s)
  end
end
for _, h in ipairs(cjson.decode(ARGV[3])) do
  if not leased[h] and redis.call('SCARD', p..':refs:'..h) == 0 then
    redis.call('DEL', p..':chunk:'..h)
    redis.call('SREM', p..':chunks', h)
    table.insert(gone_c, h)
  end
end
return {{cjson.encode(gone_s), cjson.encode(gone_c)}}
"""
"""Applies a removal decided on an earlier read, keeping whatever has since become pinned, leased or
listed: a prune on one server never removes what another reads or has just saved."""

_LEASED_NOW = f"""
local p = ARGV[1]
{_LEASED}
local out = {{}}
for h, _ in pairs(leased) do table.insert(out, h) end
return out
"""

_ADD_LEASE = f"""
local p, hs = ARGV[1], cjson.decode(ARGV[4])
for _, h in ipairs(hs) do
  if redis.call('EXISTS', p..':chunk:'..h) == 0 or redis.call('EXISTS', p..':blob:'..h) == 0 then
    return h
  end
end
local k = p..':lease:'..ARGV[2]
for i = 1, #hs, 1000 do redis.call('SADD', k, unpack(hs, i, math.min(i + 999, #hs))) end
redis.call('PEXPIRE', k, ARGV[3])
{_NOW_MS}
redis.call('ZADD', p..':leases', now + tonumber(ARGV[3]), ARGV[2])
return ''
"""
"""Leases every chunk (each row and blob still there) or none: returns the first missing hash."""

_HEARTBEAT = f"""
local p = ARGV[1]
if redis.call('ZSCORE', p..':leases', ARGV[2]) then
  {_NOW_MS}
  redis.call('ZADD', p..':leases', 'XX', now + tonumber(ARGV[3]), ARGV[2])
  redis.call('PEXPIRE', p..':lease:'..ARGV[2], ARGV[3])
end
"""

_RECORD_HIT = """
local p, hs = ARGV[1], cjson.decode(ARGV[3])
for _, h in ipairs(hs) do
  local k = p..':chunk:'..h
  if redis.call('EXISTS', k) == 1 then redis.call('HSET', k, 'last_used', ARGV[2]) end
end
local last = hs[#hs]
for _, s in ipairs(redis.call('SMEMBERS', p..':refs:'..last)) do
  local at = redis.call('LINDEX', p..':members:'..s, #hs - 1)
  if at == last and redis.call('EXISTS', p..':snap:'..s) == 1 then
    redis.call('HINCRBY', p..':snap:'..s, 'hits', 1)
    redis.call('HSET', p..':snap:'..s, 'last_used', ARGV[2])
  end
end
"""
"""The chunks move up in LRU, and so does every snapshot ending a shared prefix at the last one."""

_SET_FIELD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
return 1
"""
"""Sets (or with '' clears) one field of a row that exists: never recreates an evicted or removed row."""

_CHUNK_FIELDS = ("fingerprint", "index", "parent", "n_tokens", "codec", "stored", "raw")
_SNAP_FIELDS = ("label", "fingerprint", "n_tokens", "n_chunks", "created", "last_used", "hits", "pinned")


class RedisIndex:
    """The methods of kvflash/storage/index.py's `Index` that a store calls, over Redis."""

    def __init__(self, link: RedisLink, keys: Keys):
        self.link, self.keys, self.p = link, keys, keys.prefix
        reg = link.client.register_script
        self._add = reg(_ADD_SNAPSHOT)
        self._remove = reg(_REMOVE)
        self._leased = reg(_LEASED_NOW)
        self._add_lease = reg(_ADD_LEASE)
        self._heartbeat = reg(_HEARTBEAT)
        self._record_hit = reg(_RECORD_HIT)
        self._set_field = reg(_SET_FIELD)
        self._chains_through = reg(_CHAINS_THROUGH)

    def close(self) -> None:
        """The link is the store's to close."""

    def _pipe(self, fill: Callable) -> list:
        """One round trip: `fill(pipeline)` queues the commands."""

        def run(c):
            p = c.pipeline(transaction=False)
            fill(p)
            return p.execute()

        return self.link.call(run)

    # chunks

    def chunk_rows(self, hashes: Iterable[str]) -> dict[str, ChunkRow]:
        hashes = list(dict.fromkeys(hashes))

        def fill(p):
            for h in hashes:
                p.hgetall(self.keys.chunk(h))
                p.scard(f"{self.p}:refs:{h}")

        got = self._pipe(fill) if hashes else []
        out = {}
        for i, h in enumerate(hashes):
            if (row := _chunk_row(h, got[2 * i], got[2 * i + 1])) is not None:
                out[h] = row
        return out

    def intact(self, hashes: Sequence[str], fingerprint: str) -> set[str]:
        """Which of hashes are indexed under fingerprint and not marked damaged."""
        rows = self.chunk_rows(hashes)
        return {h for h, r in rows.items() if r.fingerprint == fingerprint and not r.damaged}

    def all_chunk_rows(self) -> dict[str, ChunkRow]:
        names = self.link.call(lambda c: c.smembers(f"{self.p}:chunks"))
        return self.chunk_rows(sorted(n.decode() for n in names))

    def mark_damaged(self, chunk_hash: str, reason: str | None) -> None:
        key = self.keys.chunk(chunk_hash)
        self.link.call(lambda c: self._set_field(keys=[key], args=["damaged", (reason or "")[:500]]))

    def record_hit(self, hashes: list[str], now: float) -> None:
        self.link.call(lambda c: self._record_hit(args=[self.p, repr(now), json.dumps(hashes)]))

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
        """As `Index.add_snapshot`, in one script."""
        rows = [
            [r.hash, r.fingerprint, r.index, r.parent_hash, r.n_tokens, r.codec, r.stored_bytes, r.raw_bytes]
            for r in new_rows
        ]
        args = [label, fingerprint, n_tokens, meta_json, repr(now), json.dumps(list(succeeds))]
        args += [json.dumps(rows), json.dumps(hashes)]
        while True:
            sid = snapshot_id or new_snapshot_id()
            keep = "1" if snapshot_id else "0"
            status, value = self.link.call(lambda c, s=sid, k=keep: self._add(args=[self.p, s, k, *args]))
            if status == b"ok":
                return value.decode()
            if status == b"missing":
                raise ChunkMissing(value.decode(), "referenced by the new snapshot but not stored")
            # b"taken": a new id collided with another snapshot's; draw again

    def snapshots(self) -> list[SnapshotInfo]:
        ids = sorted(n.decode() for n in self.link.call(lambda c: c.smembers(f"{self.p}:snaps")))

        def fill(p):
            for sid in ids:
                p.hgetall(self.keys.snap(sid))
                p.llen(self.keys.members(sid))

        got = self._pipe(fill) if ids else []
        infos = [_snapshot_info(sid, got[2 * i], got[2 * i + 1]) for i, sid in enumerate(ids)]
        return sorted((s for s in infos if s is not None), key=lambda s: s.created)

    def snapshot(self, snapshot_id: str) -> Snapshot:
        def fill(p):
            p.hgetall(self.keys.snap(snapshot_id))
            p.lrange(self.keys.members(snapshot_id), 0, -1)

        row, members = self._pipe(fill)
        info = _snapshot_info(snapshot_id, row, len(members))
        if info is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        hashes = tuple(h.decode() for h in members)
        for h in hashes:
            if not is_hash(h):
                raise ChunkCorrupt(repr(h), f"snapshot {snapshot_id} lists a malformed chunk hash")
        return Snapshot(**vars(info), chunk_hashes=hashes)

    def chains_through(self, chunk_hash: str, position: int) -> list[str]:
        """As `Index.chains_through`, in one script."""
        got = self.link.call(lambda c: self._chains_through(args=[self.p, chunk_hash, position]))
        ends = sorted((int(n), last.decode()) for last, n in got)
        return list(dict.fromkeys(last for _, last in ends))

    def chain_ends(self) -> set[str]:
        ids = sorted(n.decode() for n in self.link.call(lambda c: c.smembers(f"{self.p}:snaps")))
        got = self._pipe(lambda p: [p.lindex(self.keys.members(s), -1) for s in ids]) if ids else []
        return {h.decode() for h in got if h is not None}

    def ends_a_chain(self, chunk_hash: str) -> bool:
        return chunk_hash in self.chain_ends()

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        key = self.keys.snap(snapshot_id)
        if not self.link.call(lambda c: self._set_field(keys=[key], args=["pinned", str(int(pinned))])):
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")

    def members(self) -> dict[str, list[str]]:
        return self._members([s.id for s in self.snapshots()])

    def _members(self, ids: list[str]) -> dict[str, list[str]]:
        got = self._pipe(lambda p: [p.lrange(self.keys.members(s), 0, -1) for s in ids]) if ids else []
        return {s: [h.decode() for h in hs] for s, hs in zip(ids, got, strict=True)}

    def remove(
        self,
        decide: Callable[[PruneInput], PruneDecision],
        dry_run: bool,
        now: float,
        owner_alive: Callable[[str], bool | None],
        only: str | None = None,
    ) -> PruneDecision:
        """Decides on one read of the index, then applies the decision in one script that keeps
        anything pinned, leased or listed since. Leases live by their heartbeat here (their owners
        may be on other machines, whose locks no server can see), so `owner_alive` is not asked.
        The read is the whole index's, also for a decision about `only` one snapshot."""
        snaps = self.snapshots()
        leased = {h.decode() for h in self.link.call(lambda c: self._leased(args=[self.p]))}
        inp = PruneInput(snaps, self._members([s.id for s in snaps]), self.all_chunk_rows(), leased)
        decision = decide(inp).sized(inp.chunks)
        if dry_run or not (decision.snapshots or decision.chunks):
            return decision
        args = [self.p, json.dumps(decision.snapshots), json.dumps(decision.chunks)]
        gone_s, gone_c = self.link.call(lambda c: self._remove(args=args))
        return PruneDecision(snapshots=_json_list(gone_s), chunks=_json_list(gone_c)).sized(inp.chunks)

    # leases

    def add_lease(self, lease_id: str, owner: str, hashes: list[str], now: float) -> None:
        args = [self.p, lease_id, int(LEASE_TTL_S * 1000), json.dumps(hashes)]
        missing = self.link.call(lambda c: self._add_lease(args=args))
        if missing:
            raise ChunkMissing(missing.decode(), "not stored (pruned, evicted or never saved)")

    def heartbeat(self, lease_id: str, now: float) -> None:
        self.link.call(lambda c: self._heartbeat(args=[self.p, lease_id, int(LEASE_TTL_S * 1000)]))

    def drop_lease(self, lease_id: str) -> None:
        self._pipe(lambda p: (p.delete(f"{self.p}:lease:{lease_id}"), p.zrem(f"{self.p}:leases", lease_id)))

    # accounting

    def totals(self) -> dict[str, int]:
        rows = self.all_chunk_rows()
        snaps = self.snapshots()
        return {
            "snapshots": len(snaps),
            "pinned": sum(s.pinned for s in snaps),
            "chunks": len(rows),
            "stored_bytes": sum(r.stored_bytes for r in rows.values()),
            "raw_bytes": sum(r.raw_bytes for r in rows.values()),
            "unreferenced_bytes": sum(r.stored_bytes for r in rows.values() if not r.refcount),
            "damaged_chunks": sum(r.damaged is not None for r in rows.values()),
        }

    def refcount_errors(self) -> list[str]:
        """Chunks whose reference set disagrees with the member lists (an evicted set, say)."""
        counts: dict[str, int] = {}
        for hashes in self.members().values():
            for h in set(hashes):
                counts[h] = counts.get(h, 0) + 1
        return [h for h, r in self.all_chunk_rows().items() if r.refcount != counts.get(h, 0)]

    def malformed(self) -> list[str]:
        """Snapshots listed but incomplete (a row or member list evicted), and meta that is no JSON
        object."""
        listed = {n.decode() for n in self.link.call(lambda c: c.smembers(f"{self.p}:snaps"))}
        snaps = self.snapshots()
        gone = sorted(listed - {s.id for s in snaps})
        errors = [f"snapshot {sid}: its row or member list is gone" for sid in gone]
        raw = self._pipe(lambda p: [p.hget(self.keys.snap(s.id), "meta") for s in snaps]) if snaps else []
        bad = [s.id for s, m in zip(snaps, raw, strict=True) if parse_meta(m) is BAD_META]
        errors += [f"snapshot {sid}: meta is not a JSON object" for sid in bad]
        return errors

    def size_bytes(self) -> int:
        """Bytes Redis holds for the index's keys, by its own count (MEMORY USAGE): every key of the
        store but the blobs and summaries files."""
        files = (self.keys.blob(""), self.keys.sums(""))
        total, cursor = 0, 0
        while True:
            cursor, batch = self.link.call(lambda c, at=cursor: c.scan(at, match=f"{self.p}:*", count=1000))
            keys = [k for k in batch if not k.decode().startswith(files)]
            if keys:
                total += sum(n or 0 for n in self._pipe(lambda p, ks=keys: [p.memory_usage(k) for k in ks]))
            if cursor == 0:
                return total

    def dangling_members(self) -> list[str]:
        listed = {h for hashes in self.members().values() for h in hashes}
        return sorted(listed - set(self.chunk_rows(sorted(listed))))


def _json_list(raw: bytes) -> list[str]:
    """cjson writes an empty Lua table as `{}`."""
    out = json.loads(raw)
    return out if isinstance(out, list) else []


def _text(row: dict, field: str) -> str:
    return row[field.encode()].decode()


def _chunk_row(h: str, row: dict, refs: int) -> ChunkRow | None:
    """A row with every field, else None (a key evicted whole is empty; none is ever half-written)."""
    if not all(f.encode() in row for f in _CHUNK_FIELDS):
        return None
    damaged = row.get(b"damaged")
    return ChunkRow(
        hash=h,
        fingerprint=_text(row, "fingerprint"),
        index=int(row[b"index"]),
        parent_hash=_text(row, "parent"),
        n_tokens=int(row[b"n_tokens"]),
        codec=_text(row, "codec"),
        stored_bytes=int(row[b"stored"]),
        raw_bytes=int(row[b"raw"]),
        refcount=refs,
        damaged=damaged.decode() if damaged else None,
        created=float(row.get(b"created", 0)),
        last_used=float(row.get(b"last_used", 0)),
    )


def _snapshot_info(sid: str, row: dict, n_members: int) -> SnapshotInfo | None:
    """The row of a whole snapshot; None for one whose row or member list is gone or short."""
    if not all(f.encode() in row for f in _SNAP_FIELDS) or int(row[b"n_chunks"]) != n_members:
        return None
    try:
        return SnapshotInfo(
            id=sid,
            label=_text(row, "label"),
            fingerprint=_text(row, "fingerprint"),
            n_tokens=int(row[b"n_tokens"]),
            n_chunks=n_members,
            created=float(row[b"created"]),
            last_used=float(row[b"last_used"]),
            hits=int(row[b"hits"]),
            pinned=row[b"pinned"] == b"1",
            meta=dict(parse_meta(row.get(b"meta", b"{}"))),
            stored_bytes=int(row.get(b"stored", 0)),
            raw_bytes=int(row.get(b"raw", 0)),
        )
    except (ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"snapshot {sid}: unreadable row in the shared index ({e})") from None
