"""Where chunk files live, behind the small interface a shared backend (S3, Redis) would implement.

The local backend keeps `<root>/chunks/<2 hex>/<hash>.kvc`. A put is atomic and durable before it
returns (temp file in the same directory, fsync, rename, fsync of the directory), so the index row
written after it never names a missing or partial file.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import aiofiles

from kvflash.storage.errors import ChunkMissing, DiskFull, SizeMismatch
from kvflash.storage.names import check_hash, is_hash

_FULL = (errno.ENOSPC, errno.EDQUOT)


class ChunkBackend(Protocol):
    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        """Stores the concatenation of parts under chunk_hash, atomically and durably."""

    def get(self, chunk_hash: str, max_bytes: int, into: ReadBuffer | None = None) -> memoryview:
        """The stored bytes (in `into` when given); refuses objects over max_bytes without reading."""

    async def aget(self, chunk_hash: str, max_bytes: int) -> bytes:
        """`get` without blocking the event loop."""

    def will_need(self, chunk_hashes: Sequence[str]) -> None:
        """A hint that these objects are read next: start fetching them all now."""

    def get_range(self, chunk_hash: str, start: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes from `start`, and the object's whole size."""

    def exists(self, chunk_hash: str) -> bool: ...

    def delete(self, chunk_hash: str) -> None: ...

    def list_hashes(self) -> Iterator[str]:
        """Every stored hash, for the orphan sweep."""

    def sweep_temp(self) -> int:
        """Removes leftovers of interrupted puts; only safe while no put runs. Returns the count."""


class ReadBuffer:
    """A reusable read destination, one per thread: a fresh chunk-sized buffer per read costs page
    faults, and page faults from many reading threads contend in the kernel. A view it returns is
    valid until its next `view` call."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def view(self, n: int) -> memoryview:
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return memoryview(self._buf)[:n]


class LocalDirBackend:
    def __init__(self, root: Path):
        self.dir = Path(root) / "chunks"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._dir = str(self.dir)

    def path(self, chunk_hash: str) -> Path:
        return Path(self._file(chunk_hash))

    def _file(self, chunk_hash: str) -> str:
        """`path` as a string: pathlib joins cost a read more than its open, all of it under the GIL."""
        h = check_hash(chunk_hash)
        return f"{self._dir}/{h[:2]}/{h}.kvc"

    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        final = self.path(chunk_hash)
        tmp = final.parent / f".{chunk_hash}.{secrets.token_hex(4)}.tmp"
        try:
            self._ensure_dir(final.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in parts:
                    _write_all(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in _FULL:
                raise DiskFull(f"no space left on the device of {self.dir} while writing a chunk") from e
            raise

    def get(self, chunk_hash: str, max_bytes: int, into: ReadBuffer | None = None) -> memoryview:
        """Plain descriptor calls: a file object costs more Python work than the read needs, and every
        decode thread queues for the GIL that work holds."""
        try:
            fd = os.open(self._file(chunk_hash), os.O_RDONLY)
        except FileNotFoundError:
            raise ChunkMissing(chunk_hash, "file missing") from None
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise SizeMismatch(chunk_hash, f"file of {size} bytes exceeds any valid chunk")
            view, n = (into or ReadBuffer()).view(size), 0
            while n < size and (got := os.readv(fd, [view[n:]])):
                n += got
        finally:
            os.close(fd)
        return view[:n]

    def will_need(self, chunk_hashes: Sequence[str]) -> None:
        """Asks the kernel to read every file ahead at once, so the disk sees the whole batch's
        requests while the decode threads work through it (a thread's own read waits otherwise)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for h in chunk_hashes:
            try:
                fd = os.open(self.path(h), os.O_RDONLY)
            except OSError:
                continue  # the read itself reports it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    async def aget(self, chunk_hash: str, max_bytes: int) -> bytes:
        path = self.path(chunk_hash)
        try:
            async with aiofiles.open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > max_bytes:
                    raise SizeMismatch(chunk_hash, f"file of {size} bytes exceeds any valid chunk")
                return await f.read(size)
        except FileNotFoundError:
            raise ChunkMissing(chunk_hash, "file missing") from None

    def get_range(self, chunk_hash: str, start: int, length: int) -> tuple[bytes, int]:
        try:
            fd = os.open(self.path(chunk_hash), os.O_RDONLY)
        except FileNotFoundError:
            raise ChunkMissing(chunk_hash, "file missing") from None
        try:
            return os.pread(fd, length, start), os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, chunk_hash: str) -> bool:
        return self.path(chunk_hash).is_file()

    def delete(self, chunk_hash: str) -> None:
        self.path(chunk_hash).unlink(missing_ok=True)

    def list_hashes(self) -> Iterator[str]:
        for sub in self.dir.iterdir():
            if sub.is_dir():
                for f in sub.glob("*.kvc"):
                    if is_hash(f.stem):
                        yield f.stem

    def sweep_temp(self) -> int:
        tmps = list(self.dir.glob("*/.*.tmp"))
        for t in tmps:
            t.unlink(missing_ok=True)
        return len(tmps)

    def _ensure_dir(self, d: Path) -> None:
        """A new fan-out directory is itself made durable in its parent before files go in."""
        try:
            d.mkdir()
        except FileExistsError:
            return
        _fsync_dir(self.dir)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
