"""Reading a text file the user names (a document, a haystack): a regular file of bounded size, never
a device or a FIFO (a read of /dev/zero never ends, an open of a FIFO without a writer never
returns)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvflash import KVFlashError

MAX_DOCUMENT_BYTES = 64 << 20
"""About 16M tokens of text: beyond any context the engine runs, well within memory."""


def read_text(path: Path, what: str = "document") -> str:
    shown = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KVFlashError(f"{what} not found: {shown}") from None
    except OSError as e:
        raise KVFlashError(f"{shown}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
            raise KVFlashError(f"{shown}: not a regular file ({kind}); give a UTF-8 text file")
        if st.st_size > MAX_DOCUMENT_BYTES:
            raise KVFlashError(f"{shown}: {st.st_size:,} bytes; a {what} is at most {MAX_DOCUMENT_BYTES:,}")
        chunks, n = [], 0
        while n <= MAX_DOCUMENT_BYTES and (data := os.read(fd, 1 << 20)):
            chunks.append(data)
            n += len(data)
    except OSError as e:
        raise KVFlashError(f"{shown}: {e.strerror}") from None
    finally:
        os.close(fd)
    if n > MAX_DOCUMENT_BYTES:
        raise KVFlashError(f"{shown}: grew past {MAX_DOCUMENT_BYTES:,} bytes while read")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise KVFlashError(f"{shown}: not a UTF-8 text file") from None
