"""The connection to a shared snapshot tier on Redis, and what its failures mean to the store.

A Redis that is down, slow or restarting must cost a warning and a cold (or local) answer, never a
hung request: every call has a connect and a read timeout, redis-py retries once at most (a pooled
connection that a restarted Redis closed is reconnected, no more), and after a failure the link
fails every call at once for `retry_s` before it tries Redis again. A wrong password, a URL that is
not one or a Redis that refuses a write (full, read-only replica) is one line naming the URL.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvflash.storage.backend import HeadCheck
from kvflash.storage.errors import StoreError

T = TypeVar("T")
SCHEMES = ("redis", "rediss", "unix")


class SharedUnavailable(StoreError):
    """The shared tier cannot be reached now (down, slow, restarting): serve locally or cold."""


@dataclass(frozen=True)
class RedisConfig:
    url: str
    connect_timeout_s: float = 1.0
    timeout_s: float = 5.0
    """Per call: a chunk is a few MB, which loopback or a LAN moves in milliseconds."""
    retry_s: float = 5.0
    """After a failure, calls fail at once for this long, then Redis is tried again."""
    prefix: str = "kvflash"
    """Every key starts with it, so one Redis database can hold other data beside the store."""
    unindexed_ttl_s: int = 3600
    """A chunk written by a save that has not committed expires after this: a save killed between
    its chunks and its index entry leaves nothing behind for long."""


def shown_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return parts._replace(netloc=user + parts.netloc.rsplit("@", 1)[1]).geturl()


class RedisLink:
    """One client (a thread-safe connection pool) and the state of the tier: up, or down until a
    retry time. Safe across threads."""

    def __init__(self, cfg: RedisConfig):
        self.cfg = cfg
        self.where = shown_url(cfg.url)
        if urlsplit(cfg.url).scheme not in SCHEMES:
            raise StoreError(f"{self.where!r:.120} is not a Redis URL (redis://HOST:PORT/DB)")
        try:
            self.client = redis.Redis.from_url(
                cfg.url,
                socket_connect_timeout=cfg.connect_timeout_s,
                socket_timeout=cfg.timeout_s,
                retry=Retry(NoBackoff(), 1),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        except ValueError as e:
            raise StoreError(f"{self.where!r:.120} is not a Redis URL: {e}") from None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[redis.Redis], T]) -> T:
        """fn(client), its Redis errors as StoreError: SharedUnavailable for one that a later call
        may not meet (the first warns once; calls within `retry_s` fail without trying)."""
        if time.monotonic() < self._down_until:
            raise SharedUnavailable(f"the shared store {self.where} is unreachable; retrying shortly")
        try:
            out = fn(self.client)
        except redis.AuthenticationError as e:
            raise StoreError(f"the shared store {self.where} refused the password: {e}") from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise StoreError(f"the shared store {self.where} needs a password: {e}") from None
            if str(e).startswith("BUSY"):  # a script of another client overran: this one is slow
                raise self._down(e) from None
            raise StoreError(f"the shared store {self.where} refused a command: {e}") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            raise self._down(e) from None
        if self._down_until:
            with self._lock:
                if self._down_until:
                    self._down_until = 0.0
                    warnings.warn(f"the shared store {self.where} is reachable again", stacklevel=3)
        return out

    def _down(self, e: Exception) -> SharedUnavailable:
        with self._lock:
            first = not self._down_until
            self._down_until = time.monotonic() + self.cfg.retry_s
        msg = f"the shared store {self.where} is unreachable ({e})"
        if first:
            warnings.warn(f"{msg}; serving without it, retrying every {self.cfg.retry_s:g} s", stacklevel=4)
        return SharedUnavailable(msg)

    def get_into(
        self, key: str, dest: Callable[[int], memoryview], head: int = 0, check: HeadCheck | None = None
    ) -> memoryview | None:
        """GET of one value, read from the socket straight into `dest(size)` (None: no such key).
        redis-py would parse the reply into a new bytes object, a fresh value-sized allocation and
        one more copy per read. `dest` may refuse the size, and `check` the first `head` bytes and
        the size, before the rest is read; either way the connection is dropped, not reused."""
        return self.call(lambda c: _get_into(c, key, dest, head, check))

    def check(self) -> None:
        """One round trip: a wrong password, a URL or a Redis that is not there raises here, before
        a server starts on it (as an error, not also as a warning)."""
        try:
            self.client.ping()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            if not isinstance(e, redis.AuthenticationError):
                raise SharedUnavailable(f"the shared store {self.where} is unreachable ({e})") from None
        self.call(lambda c: c.ping())

    def close(self) -> None:
        self.client.close()


_LINE = 64
"""Bytes asked of the socket while reading a reply's first line: `$<size>` and the CRLF."""


@contextmanager
def _connection(client: redis.Redis) -> Iterator[redis.Connection]:
    """A connection of the client's pool, disconnected on any failure: a reply read halfway leaves
    the stream mid-value."""
    conn = client.connection_pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        client.connection_pool.release(conn)


def _get_into(
    client: redis.Redis, key: str, dest: Callable[[int], memoryview], head: int, check: HeadCheck | None
) -> memoryview | None:
    with _connection(client) as conn:
        conn.send_command("GET", key)
        sock = conn._sock  # the pool hands out connected connections with nothing left to read
        line = bytearray()
        while (end := line.find(b"\r\n")) < 0:
            line += _recv(sock, _LINE)
        if line[:1] == b"-":
            raise redis.ResponseError(line[1:end].decode(errors="replace"))
        if line[:1] == b"_":  # RESP3's null
            return None
        if line[:1] != b"$" or not line[1:end].lstrip(b"-").isdigit():
            raise redis.ConnectionError(f"unexpected reply to GET: {bytes(line[:end])[:40]!r}")
        size = int(line[1:end])
        if size < 0:
            return None
        view = dest(size)
        have = line[end + 2 : end + 2 + size]
        view[: len(have)] = have
        trailer = line[end + 2 + size :]
        n = _fill(sock, view, len(have), min(head, size))
        if check is not None:
            check(view[: min(head, size)], size)
        _fill(sock, view, n, size)
        while len(trailer) < 2:
            trailer += _recv(sock, 2 - len(trailer))
        return view


def _fill(sock, view: memoryview, n: int, stop: int) -> int:
    """Reads into view[n:stop] (n bytes are there already); returns the bytes now there."""
    while n < stop:
        got = sock.recv_into(view[n:stop])
        if not got:
            raise redis.ConnectionError("the shared store closed the connection")
        n += got
    return max(n, stop)


def _recv(sock, n: int) -> bytes:
    got = sock.recv(n)
    if not got:
        raise redis.ConnectionError("the shared store closed the connection")
    return got


class Keys:
    """Every key of one store. Chunk hashes and snapshot ids are validated hex before they get
    here, so no caller's text becomes part of a key."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def blob(self, h: str) -> str:
        return f"{self.prefix}:blob:{h}"

    def chunk(self, h: str) -> str:
        return f"{self.prefix}:chunk:{h}"

    def snap(self, sid: str) -> str:
        return f"{self.prefix}:snap:{sid}"

    def members(self, sid: str) -> str:
        return f"{self.prefix}:members:{sid}"

    def sums(self, h: str) -> str:
        """The summaries file of the chain ending at h."""
        return f"{self.prefix}:sums:{h}"

    @property
    def blobs(self) -> str:
        """A SCAN pattern over every chunk blob."""
        return f"{self.prefix}:blob:*"

    @property
    def all_sums(self) -> str:
        """A SCAN pattern over every summaries file."""
        return f"{self.prefix}:sums:*"
