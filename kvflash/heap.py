"""Memory that glibc's malloc keeps after it is freed.

malloc serves allocations below its mmap threshold (which grows up to 32 MiB as large blocks are
freed) from its arenas, and hands arena memory back to the system only from the top of the main
heap: memory freed below a live block stays in the process's RSS, free for malloc to reuse.
`trim` hands it back where a process has just freed much of it (docs/RELIABILITY.md: Serving).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its malloc keeps no such memory, or cannot say
        return None


def trim() -> None:
    """Returns the whole free pages of every malloc arena to the system (glibc's malloc_trim);
    nothing where the C library is not glibc."""
    if (fn := _malloc_trim()) is not None:
        fn(0)
