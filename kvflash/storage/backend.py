"""Where chunk files live, behind the small interface a shared backend (S3, Redis) would implement:
`ChunkBackend`, and the types its reads take. The store's own backend keeps a local directory
(kvflash/storage/local_backend.py); a shared tier's keeps Redis (kvflash/storage/redis_backend.py).

A backend holds two kinds of objects, both named by a chain hash: chunk files, and the summaries
files of snapshots (kvflash/storage/summaries.py, named by their chain's last hash). A put is atomic
and durable before it returns, so the index row written after it never names a missing or partial
file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

HeadCheck = Callable[[memoryview, int], object]
"""Sees a file's first bytes and its size before the rest is read; raises to refuse the file."""
ReadPlan = Callable[[memoryview, int], Sequence[tuple[int, memoryview]]]
"""Sees a file's first bytes and its size; returns where the rest of what is read goes, as (offset in
the file, destination) pairs, each destination filled whole. Raises to refuse the file."""


class ChunkBackend(Protocol):
    def put(self, chunk_hash: str, parts: Sequence[bytes]) -> None:
        """Stores the concatenation of parts under chunk_hash, atomically and durably."""

    def get(
        self,
        chunk_hash: str,
        max_bytes: int,
        into: ReadBuffer | None = None,
        head: int = 0,
        check: HeadCheck | None = None,
    ) -> memoryview:
        """The stored bytes (in `into` when given); refuses objects over max_bytes without reading,
        and those that `check` refuses once it has seen their first `head` bytes."""

    def will_need(self, chunk_hashes: Sequence[str]) -> None:
        """A hint that these objects are read next: start fetching them all now."""

    def get_range(self, chunk_hash: str, start: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes from `start`, and the object's whole size."""

    def exists(self, chunk_hash: str) -> bool: ...

    def exists_all(self, chunk_hashes: Sequence[str]) -> list[bool]:
        """`exists` of each, at once where the backend can ask for many in one request."""

    def delete(self, chunk_hash: str) -> None: ...

    def list_files(self) -> Iterator[tuple[str, int]]:
        """(hash, size) of every stored object, for the orphan sweep and accounting."""

    def list_temp(self) -> Iterator[tuple[str, int]]:
        """(name, size) of every leftover of an interrupted put."""

    def sweep_temp(self) -> int:
        """Removes leftovers of interrupted puts; only safe while no put runs. Returns the count."""

    def put_summaries(self, last_hash: str, parts: Sequence[bytes]) -> None:
        """Stores a snapshot's summaries file, as `put` a chunk file."""

    def get_summaries(self, last_hash: str, head: int, plan: ReadPlan) -> None:
        """Reads a summaries file's first `head` bytes, then the ranges `plan` asks for into the
        destinations it gives (on disk straight from one descriptor of the file, with no copy)."""

    def delete_summaries(self, last_hash: str) -> None: ...

    def list_summaries(self) -> Iterator[tuple[str, int]]:
        """(last hash, size) of every summaries file, as `list_files` of chunk files."""


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
