"""`LocalDirBackend`: chunk and summaries files in a store's directory, `<root>/chunks/<2 hex>/<hash>.kvc`
and `<hash>.kvs` beside it. A put is atomic and durable before it returns (temp file in the same
directory, fsync, rename, fsync of the directory).

Nothing it does reaches outside `chunks/`: a fan-out directory is opened with O_NOFOLLOW and every
file is opened, created, renamed or unlinked relative to that descriptor, again without following a
symlink; a reader takes only regular files (a FIFO would block a read, a directory fail it), opened
non-blocking so that even opening one cannot hang. Those rules are why it is one class: each of its
operations goes through the same guarded opens (`_fanout`, `_open`, `_put_dir`).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvflash.storage.backend import HeadCheck, ReadBuffer, ReadPlan
from kvflash.storage.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    ChunkUnavailable,
    DiskFull,
    SizeMismatch,
    StoreError,
)
from kvflash.storage.names import check_hash, is_hash

_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_OURS = (errno.ELOOP, errno.ENOTDIR)
"""What O_NOFOLLOW and O_DIRECTORY answer for a symlink or a non-directory in the path."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TEMP = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]+\.tmp")

CHUNK, SUMMARIES = ".kvc", ".kvs"


class LocalDirBackend:
    def __init__(self, root: Path):
        self.dir = Path(root) / "chunks"
        self._dir = str(self.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            if not self.dir.is_dir():  # a read-only store without chunks: every read is a miss
                raise

    def path(self, chunk_hash: str, suffix: str = CHUNK) -> Path:
        h = check_hash(chunk_hash)
        return self.dir / h[:2] / f"{h}{suffix}"

    @contextmanager
    def _fanout(self, chunk_hash: str) -> Iterator[int]:
        """A descriptor of the chunk's fan-out directory, which must be a directory of the store:
        ChunkMissing when absent, ChunkCorrupt when a symlink or not a directory."""
        h = check_hash(chunk_hash)
        try:
            dfd = os.open(f"{self._dir}/{h[:2]}", _DIR_FLAGS)
        except FileNotFoundError:
            raise ChunkMissing(h, "file missing") from None
        except OSError as e:
            if e.errno in _NOT_OURS:
                raise ChunkCorrupt(h, f"chunks/{h[:2]} is a symlink or not a directory: not read") from None
            raise ChunkUnavailable(h, f"chunks/{h[:2]}: {e.strerror}") from None
        try:
            yield dfd
        finally:
            os.close(dfd)

    def _open(self, chunk_hash: str, suffix: str = CHUNK) -> int:
        """A read descriptor of a regular file of the store, never a symlink's target."""
        with self._fanout(chunk_hash) as dfd:
            try:
                fd = os.open(f"{chunk_hash}{suffix}", _READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise ChunkMissing(chunk_hash, "file missing") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ChunkCorrupt(chunk_hash, "the chunk file is a symlink: not followed") from None
                raise ChunkUnavailable(chunk_hash, f"cannot open the chunk file: {e.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ChunkCorrupt(chunk_hash, f"not a regular file ({_kind(mode)})")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        self._put(chunk_hash, parts, CHUNK)

    def put_summaries(self, last_hash: str, parts: Sequence[bytes]) -> None:
        self._put(last_hash, parts, SUMMARIES)

    def _put(self, chunk_hash: str, parts: Sequence[bytes], suffix: str) -> None:
        name = f"{check_hash(chunk_hash)}{suffix}"
        tmp = f".{chunk_hash}.{secrets.token_hex(4)}.tmp"
        try:
            dfd = self._put_dir(chunk_hash)
        except OSError as e:
            raise _write_error(e, self.dir) from e
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
            )
            try:
                for part in parts:
                    _write_all(fd, part)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                    raise StoreError(
                        f"{self.dir / chunk_hash[:2] / name} is a directory, not a chunk file; remove it"
                    ) from None
                raise
            os.fsync(dfd)
        except BaseException as e:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise _write_error(e, self.dir) from e
            raise
        finally:
            os.close(dfd)

    def _put_dir(self, chunk_hash: str) -> int:
        """The fan-out directory to write into, made (durably) if new; refuses a symlink."""
        sub = f"{self._dir}/{chunk_hash[:2]}"
        try:
            return os.open(sub, _DIR_FLAGS)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno in _NOT_OURS:
                raise StoreError(
                    f"{sub} is a symlink or not a directory: the store does not write through it"
                ) from None
            raise
        self.dir.mkdir(parents=True, exist_ok=True)  # `chunks/` itself may have been deleted
        try:
            os.mkdir(sub)
            _fsync_dir(self._dir)
        except FileExistsError:
            pass
        return self._put_dir(chunk_hash)

    def get(
        self,
        chunk_hash: str,
        max_bytes: int,
        into: ReadBuffer | None = None,
        head: int = 0,
        check: HeadCheck | None = None,
    ) -> memoryview:
        """Plain descriptor calls: a file object costs more Python work than the read needs, and every
        decode thread queues for the GIL that work holds. With `check`, the first `head` bytes are read
        first, so a header whose sizes disagree with the file is refused before the rest is read."""
        fd = self._open(chunk_hash)
        try:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise SizeMismatch(chunk_hash, f"file of {size} bytes exceeds any valid chunk")
            n = 0
            if check is not None:
                check(memoryview(os.pread(fd, min(head, size), 0)), size)
            view = (into or ReadBuffer()).view(size)
            while n < size and (got := os.readv(fd, [view[n:]])):
                n += got
        except OSError as e:
            raise ChunkUnavailable(chunk_hash, f"read failed: {e.strerror}") from None
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
                fd = self._open(h)
            except StoreError:
                continue  # the read itself reports it
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def get_summaries(self, last_hash: str, head: int, plan: ReadPlan) -> None:
        """One descriptor for the whole read, so every range comes from one version of the file."""
        fd = self._open(last_hash, SUMMARIES)
        try:
            size = os.fstat(fd).st_size
            first = memoryview(os.pread(fd, min(head, size), 0))
            for offset, dest in plan(first, size):
                _read_into(fd, dest, offset, last_hash)
        except OSError as e:
            raise ChunkUnavailable(last_hash, f"read failed: {e.strerror}") from None
        finally:
            os.close(fd)

    def get_range(self, chunk_hash: str, start: int, length: int) -> tuple[bytes, int]:
        fd = self._open(chunk_hash)
        try:
            return os.pread(fd, length, start), os.fstat(fd).st_size
        except OSError as e:
            raise ChunkUnavailable(chunk_hash, f"read failed: {e.strerror}") from None
        finally:
            os.close(fd)

    def exists(self, chunk_hash: str) -> bool:
        """A regular file under the chunk's name, in a fan-out directory that is not a symlink."""
        return self.exists_all([chunk_hash])[0]

    def exists_all(self, chunk_hashes: Sequence[str]) -> list[bool]:
        """`exists` of each, opening each fan-out directory once (a chain's chunks share the 256 of
        them): one stat a chunk instead of an open, a stat and a close."""
        by_dir: dict[str, list[int]] = {}
        for i, h in enumerate(chunk_hashes):
            by_dir.setdefault(check_hash(h)[:2], []).append(i)
        out = [False] * len(chunk_hashes)
        for members in by_dir.values():
            try:
                with self._fanout(chunk_hashes[members[0]]) as dfd:
                    for i in members:
                        out[i] = _is_file(f"{chunk_hashes[i]}{CHUNK}", dfd)
            except StoreError:
                pass  # no fan-out directory of the store: none of these is stored
        return out

    def delete(self, chunk_hash: str) -> None:
        self._delete(chunk_hash, CHUNK)

    def delete_summaries(self, last_hash: str) -> None:
        self._delete(last_hash, SUMMARIES)

    def _delete(self, chunk_hash: str, suffix: str) -> None:
        """Unlinks the name in the store (a symlink itself, never its target); an empty directory in
        its place goes too, anything else stays."""
        h = check_hash(chunk_hash)
        try:
            with self._fanout(h) as dfd:
                _unlink_at(dfd, f"{h}{suffix}")
        except ChunkError:
            pass  # no fan-out directory of the store: nothing of the store to delete

    def list_files(self) -> Iterator[tuple[str, int]]:
        return self._list(CHUNK)

    def list_summaries(self) -> Iterator[tuple[str, int]]:
        return self._list(SUMMARIES)

    def _list(self, suffix: str) -> Iterator[tuple[str, int]]:
        for sub, entry in self._entries():
            name = entry.name
            if name.endswith(suffix) and is_hash(h := name[: -len(suffix)]) and h[:2] == sub:
                yield h, entry.stat(follow_symlinks=False).st_size

    def list_hashes(self) -> Iterator[str]:
        for h, _ in self.list_files():
            yield h

    def list_temp(self) -> Iterator[tuple[str, int]]:
        for sub, entry in self._entries():
            if _TEMP.fullmatch(entry.name):
                yield f"{sub}/{entry.name}", entry.stat(follow_symlinks=False).st_size

    def sweep_temp(self) -> int:
        n = 0
        for name, _ in list(self.list_temp()):
            sub, file = name.split("/")
            try:
                dfd = os.open(f"{self._dir}/{sub}", _DIR_FLAGS)
            except OSError:
                continue
            try:
                n += _unlink_at(dfd, file)
            finally:
                os.close(dfd)
        return n

    def _entries(self) -> Iterator[tuple[str, os.DirEntry]]:
        """Regular files of the fan-out directories, never through a symlink."""
        try:
            subs = [e for e in os.scandir(self._dir) if e.is_dir(follow_symlinks=False) and len(e.name) == 2]
        except FileNotFoundError:
            return
        for sub in subs:
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in files:
                if entry.is_file(follow_symlinks=False):
                    yield sub.name, entry


def _is_file(name: str, dfd: int) -> bool:
    """A regular file under name in the directory dfd (a symlink is not one)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file"


def _unlink_at(dfd: int, name: str) -> int:
    """1 if `name` went; an empty directory under it is removed, a full one is left."""
    try:
        os.unlink(name, dir_fd=dfd)
        return 1
    except FileNotFoundError:
        return 0
    except (IsADirectoryError, PermissionError):
        try:
            os.rmdir(name, dir_fd=dfd)
            return 1
        except OSError:
            return 0


def _write_error(e: OSError, where: Path) -> StoreError:
    if e.errno in _FULL:
        return DiskFull(f"no space left on the device of {where} while writing a chunk")
    if e.errno == errno.EROFS:
        return StoreError(f"{where} is on a read-only file system: nothing saved")
    return StoreError(f"cannot write a chunk under {where}: {e.strerror}")


def _read_into(fd: int, dest: memoryview, offset: int, name: str) -> None:
    """Fills dest from the file at offset; a file shorter than its header said is damage."""
    n = 0
    while n < len(dest):
        got = os.preadv(fd, [dest[n:]], offset + n)
        if not got:
            raise ChunkCorrupt(name, f"truncated: {len(dest) - n} bytes short at {offset + n}")
        n += got


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
