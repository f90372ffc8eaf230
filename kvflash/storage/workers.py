"""Chunk decoding and encoding in worker processes, for restores and saves that outgrow the GIL.

A restore thread holds the GIL for 12-17 % of its time (header parsing, checks, numpy and torch set-up
around the native zstd and plane-merge calls), so threads stop scaling at about 8. Processes scale
with the cores (docs/BENCHMARKS.md: Snapshot store), and leave the parent's GIL to the engine: a
server's scheduler thread shares its interpreter with the store's threads, and every GIL hand-off to
one of them delays its next kernel launch (docs/BENCHMARKS.md: The scheduler alone).

Each worker is a Python process running `serve` and owns a shared-memory segment (a file in
/dev/shm, unlinked as soon as it is opened: the worker inherits the descriptor, so nothing outlives
the two processes). Messages are JSON over its stdin and stdout; bulk data goes through the segment.
- A read: the parent sends a run of chunk hashes; the worker reads, checks and decodes as many as fit
  into its segment and answers with their offsets and metadata, or with the chunk error that stopped
  it; the parent copies the KV out.
- A write: the parent copies one chunk's KV and summary into the segment and sends its chain fields;
  the worker encodes it, writes its file (durable, as the store's threads would) and answers with
  the file's index row, or with the store error that stopped it.
Only JSON crosses the pipes: nothing read from disk is ever unpickled.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import queue
import secrets
import select
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

import numpy as np
import torch

from kvflash.storage import errors
from kvflash.storage.backend import ReadBuffer
from kvflash.storage.chunk import ChunkBlob
from kvflash.storage.codec import DTYPE_CODES, DTYPES_BY_CODE, Codec, held_shape, kv_shape
from kvflash.storage.format import HEADER_SIZE, MAX_FILE_BYTES, decode_chunk, encode_chunk, parse_header
from kvflash.storage.local_backend import LocalDirBackend
from kvflash.storage.records import ChunkRow

SEGMENT_BYTES = 32 << 20
"""Shared memory per worker: a run of ~20 SmolLM2 chunks or 3 of an 8B Llama's; a chunk larger than
this is decoded or encoded by the parent's threads."""
REPLY_TIMEOUT_S = 60.0
"""A run of chunks is a segment's worth (32 MiB), decoded in well under a second, and a write is one
chunk: a worker silent this long is hung, and is killed so that the work goes to the threads instead
of waiting forever."""
MIN_CORES = 8
"""Below this many cores threads are not GIL-bound (2-core VM: two threads decode 1.8x one), and
starting processes (each imports torch) costs more than it saves."""
_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.ChunkMissing,
        errors.ChunkCorrupt,
        errors.SizeMismatch,
        errors.ChunkMismatch,
        errors.UnsupportedVersion,
        errors.ForeignFingerprint,
        errors.ChunkUnavailable,
    )
}
"""A read's chunk errors, which the chunk's file causes (its damage, or a read the file system
refused), not the worker."""
_WRITE_ERRORS = {cls.__name__: cls for cls in (errors.StoreError, errors.DiskFull)}
"""A write's store errors (a full disk, a store directory in the way): the threads would meet them too."""
ROW_FIELDS = ("hash", "fingerprint", "index", "parent_hash", "n_tokens", "codec", "stored_bytes", "raw_bytes")
"""The fields of a written chunk's index row that a write's reply carries (the rest are the index's)."""


def default_processes() -> int:
    cores = os.cpu_count() or 1
    return min(cores, 16) if cores >= MIN_CORES else 0


class WorkerFailed(errors.StoreError):
    """A worker could not serve a run: it died or broke its protocol (`broken`: no more runs go to
    the workers), or a chunk does not fit its segment. The caller reads the chunks itself."""

    def __init__(self, message: str, broken: bool = True):
        super().__init__(message)
        self.broken = broken


@dataclass
class _Decoded:
    index: int
    chain_hash: str
    parent_hash: str
    tokens: list[int]
    dtype: torch.dtype
    shape: tuple[int, ...]
    kv_at: int
    summary_shape: tuple[int, ...]
    summary_at: int | None
    """None: read without its summary."""


def _send(stream: IO[bytes], msg: object) -> None:
    data = json.dumps(msg).encode()
    stream.write(len(data).to_bytes(4, "little") + data)
    stream.flush()


def _recv(stream: IO[bytes]) -> object:
    """One message; EOFError if the other side has gone."""
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("pipe closed")
    n = int.from_bytes(head, "little")
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("pipe closed mid-message")
    return json.loads(data)


class _Worker:
    def __init__(self, root: str, segment_bytes: int):
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(shm_dir, f"kvflash-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # The name is gone before anything can fail: the worker inherits the descriptor, so no
            # death of either process (before the greeting included) can leave the segment behind.
            os.unlink(path)
            os.ftruncate(fd, segment_bytes)
            self.mem = mmap.mmap(fd, segment_bytes)
            # A fresh interpreter that imports this module alone, not multiprocessing's spawn: that
            # would import the parent's __main__ (the whole CLI, Triton included) in every worker.
            # Before any import: the protocol gets its own copy of stdout and fd 1 becomes stderr,
            # so nothing printed, by Python or native code, can land in the parent's pipe; and
            # SIGINT is ignored, since Ctrl-C in a terminal reaches the whole process group and the
            # parent decides what it means (its death reaches a worker as EOF).
            code = (
                "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "out = os.dup(1); os.dup2(2, 1); "
                f"from {__name__} import serve; serve(out, *sys.argv[1:])"
            )
            cmd = [sys.executable, "-c", code, root, str(fd), str(segment_bytes)]
            try:
                self.proc = subprocess.Popen(
                    cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,)
                )
            except BaseException:
                self.mem.close()
                raise
        finally:
            os.close(fd)

    def ask(self, msg: dict) -> dict:
        """Sends one request and returns the reply; WorkerFailed if the worker is dead, hung or
        breaks the protocol."""
        try:
            _send(self.proc.stdin, msg)
            if not select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)[0]:
                self.proc.kill()  # hung (stopped, or stuck in I/O): it is of no use any more
                raise WorkerFailed(f"store worker: no reply in {REPLY_TIMEOUT_S} s")
            reply = _recv(self.proc.stdout)
        except (EOFError, OSError, ValueError) as e:
            raise WorkerFailed(f"store worker: {e!r}") from None
        if not isinstance(reply, dict):
            raise WorkerFailed(f"store worker: a reply that is not an object: {reply!r:.80}")
        return reply

    def run(
        self, hashes: Sequence[str], fp: str, with_summary: bool
    ) -> tuple[list[_Decoded], errors.ChunkError | None]:
        """Decodes a prefix of `hashes` (at least one chunk, unless the first fails or does not fit)."""
        reply = self.ask({"op": "read", "hashes": list(hashes), "fp": fp, "summary": with_summary})
        try:
            done = [
                _Decoded(
                    c["index"],
                    c["hash"],
                    c["parent"],
                    c["tokens"],
                    DTYPES_BY_CODE[c["dtype"]],
                    tuple(c["shape"]),
                    c["kv_at"],
                    tuple(c["summary_shape"]),
                    c["summary_at"],
                )
                for c in reply["chunks"]
            ]
            err = reply.get("error")
        except (KeyError, TypeError) as e:
            raise WorkerFailed(f"store worker: {e!r}") from None
        if err is None:
            return done, None
        if err["type"] not in _ERRORS:
            raise WorkerFailed(f"store worker: {err['type']}: {err['reason']}")
        return done, _ERRORS[err["type"]](err["hash"], err["reason"])

    def write(self, blob: ChunkBlob, codec: Codec, level: int) -> ChunkRow:
        """Encodes and writes one chunk (its KV and summary copied into the segment first)."""
        kv, summary = blob.kv.contiguous(), blob.summary.detach().to(torch.float32).contiguous()
        kv_bytes = kv.numel() * kv.element_size()
        sum_at = kv_bytes + (-kv_bytes % 64)
        if sum_at + 4 * summary.numel() > len(self.mem):
            raise WorkerFailed(f"chunk {blob.chain_hash[:16]} exceeds a worker's segment", broken=False)
        # numpy copies without the GIL (the KV may be a pinned host-tier slot)
        np.copyto(np.frombuffer(self.mem, np.uint8, kv_bytes, 0), kv.view(torch.uint8).numpy().reshape(-1))
        np.copyto(np.frombuffer(self.mem, "<f4", summary.numel(), sum_at), summary.numpy().reshape(-1))
        reply = self.ask(
            {
                "op": "write",
                "fp": blob.fingerprint,
                "index": blob.index,
                "hash": blob.chain_hash,
                "parent": blob.parent_hash,
                "tokens": list(blob.tokens),
                "dtype": DTYPE_CODES[kv.dtype],
                "shape": list(kv.shape),
                "summary_shape": list(summary.shape),
                "summary_at": sum_at,
                "codec": int(codec),
                "level": level,
            }
        )
        try:
            if (err := reply.get("error")) is not None:
                if err["type"] in _WRITE_ERRORS:
                    raise _WRITE_ERRORS[err["type"]](err["reason"])
                raise WorkerFailed(f"store worker: {err['type']}: {err['reason']}", broken=False)
            return ChunkRow(**reply["row"])
        except (KeyError, TypeError) as e:
            raise WorkerFailed(f"store worker: {e!r}") from None

    def greeted(self, give_up: Callable[[], bool]) -> bool:
        """Waits for the worker's greeting (it has imported its modules and mapped the segment);
        False if it died first or `give_up()` turned true."""
        while not select.select([self.proc.stdout], [], [], 0.1)[0]:
            if give_up() or self.proc.poll() is not None:
                return False
        try:
            if _recv(self.proc.stdout) != "ready":
                return False
        except (EOFError, OSError, ValueError):
            return False
        return True

    def stop(self) -> None:
        """Tells the worker to exit; `close` waits for it."""
        with contextlib.suppress(OSError):
            _send(self.proc.stdin, None)

    def close(self) -> None:
        """After `stop`: waits for the exit (killing a worker that hangs) and frees the segment."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # a dead worker's stdin still holds the unsent stop
                pipe.close()
        self.mem.close()


class StoreWorkers:
    """n worker processes, started in the background when made (each imports torch: a second or two).
    The store sends reads and writes here once a worker is `ready`, never waiting for start-up;
    `read` and `write` block until one of the ready workers is free."""

    def __init__(self, root: str, n: int, segment_bytes: int = SEGMENT_BYTES):
        self.n, self.segment_bytes = n, segment_bytes
        self._free: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._broken = False
        self._lock = threading.Lock()
        self.decoded = 0
        """Chunks the workers have read."""
        self.encoded = 0
        """Chunks the workers have written."""
        self.n_ready = 0
        self._started = threading.Thread(target=self._start, args=(root,), daemon=True)
        self._started.start()

    def _start(self, root: str) -> None:
        for _ in range(self.n):  # all launched first: they import in parallel
            with self._lock:
                if self._broken:
                    return
                try:
                    self._all.append(_Worker(root, self.segment_bytes))
                except OSError:  # no shared memory or no processes here: the threads do the work
                    self._broken = True
                    return
        for w in self._all:
            if not w.greeted(lambda: self._broken):
                self._broken = True
                return
            self.n_ready += 1
            self._free.put(w)

    def wait(self) -> None:
        """Blocks until every worker is ready or start-up failed (a benchmark keeps start-up out of
        its clocks this way)."""
        self._started.join()

    @property
    def ready(self) -> bool:
        return self.n_ready > 0 and not self._broken

    def read(
        self,
        hashes: Sequence[str],
        fp: str,
        shape: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        outs: Sequence[torch.Tensor | None],
        with_summary: bool,
    ) -> list[ChunkBlob]:
        """The blobs of `hashes`, KV copied into `outs[i]` where given (the caller has checked them
        as host memory); `shape` and `dtype`, where given, are expected of every chunk; summaries
        None without `with_summary` (format.decode_chunk). Raises the first chunk's ChunkError, or
        WorkerFailed (the caller then reads the chunks itself)."""
        with self._borrowed() as w:
            blobs: list[ChunkBlob] = []
            while len(blobs) < len(hashes):
                done, err = w.run(hashes[len(blobs) :], fp, with_summary)
                for d in done:
                    blobs.append(self._copy_out(w, d, fp, shape, dtype, outs[len(blobs)]))
                if err is not None:
                    raise err
                if not done:
                    raise WorkerFailed(f"chunk {hashes[len(blobs)][:16]} exceeds a worker's segment", False)
        with self._lock:
            self.decoded += len(blobs)
        return blobs

    def write(self, blob: ChunkBlob, codec: Codec, level: int) -> ChunkRow:
        """Encodes and writes one chunk in a worker; returns its index row. Raises the store error
        that stopped it (StoreError, DiskFull), or WorkerFailed (the caller then writes it itself)."""
        with self._borrowed() as w:
            row = w.write(blob, codec, level)
        with self._lock:
            self.encoded += 1
        return row

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[_Worker]:
        """A free worker, given back afterwards; one that fails broken retires them all."""
        w = self._take_worker()
        try:
            yield w
        except WorkerFailed as e:
            self._broken |= e.broken
            raise
        finally:
            self._free.put(w)

    def _take_worker(self) -> _Worker:
        while True:
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                if self._broken:
                    raise WorkerFailed("the store workers stopped") from None

    @staticmethod
    def _copy_out(
        w: _Worker,
        d: _Decoded,
        fp: str,
        shape: tuple[int, ...] | None,
        dtype: torch.dtype | None,
        out: torch.Tensor | None,
    ) -> ChunkBlob:
        if out is not None:
            shape, dtype = kv_shape(out), out.dtype
        if (shape is not None and shape != d.shape) or (dtype is not None and dtype != d.dtype):
            raise errors.ChunkMismatch(
                d.chain_hash, f"shape {list(d.shape)} {d.dtype}, expected {list(shape or d.shape)} {dtype}"
            )
        kv = torch.empty(held_shape(d.dtype, d.shape), dtype=d.dtype) if out is None else out
        size = kv.numel() * kv.element_size()
        # numpy copies without the GIL; torch's copy_ would start an OpenMP team from each thread
        np.copyto(kv.view(torch.uint8).numpy().reshape(-1), np.frombuffer(w.mem, np.uint8, size, d.kv_at))
        summary = None
        if d.summary_at is not None:
            n_sum = int(np.prod(d.summary_shape))
            rows = np.frombuffer(w.mem, "<f4", n_sum, d.summary_at).reshape(d.summary_shape)
            summary = torch.from_numpy(rows.copy())
        return ChunkBlob(fp, d.index, d.chain_hash, d.parent_hash, d.tokens, summary, kv)

    def close(self) -> None:
        with self._lock:
            self._broken = True
        self._started.join()
        for w in self._all:  # all told first, so that they exit together, not one after another
            w.stop()
        for w in self._all:
            w.close()
        self._all.clear()


def serve(out_fd: int, root: str, shm_fd: str, segment_bytes: str) -> None:
    """A worker's loop: map the segment (an inherited descriptor), greet, then read runs and write
    chunks until told to stop (JSON null). Messages are length-prefixed JSON on stdin and on
    `out_fd`, the pipe that was stdout."""
    conn_in, conn_out = sys.stdin.buffer, os.fdopen(out_fd, "wb")
    torch.set_num_threads(1)
    fd = int(shm_fd)
    try:
        mem = mmap.mmap(fd, int(segment_bytes))
    finally:
        os.close(fd)
    backend = LocalDirBackend(Path(root))
    buf = ReadBuffer()
    try:
        _send(conn_out, "ready")
        while (msg := _recv(conn_in)) is not None:
            if msg["op"] == "write":
                _send(conn_out, _encode_write(backend, mem, msg))
            else:
                _send(conn_out, _decode_run(backend, buf, mem, msg["hashes"], msg["fp"], msg["summary"]))
    except (EOFError, BrokenPipeError):  # the parent has gone without a stop message
        pass
    mem.close()
    # Nothing is left to flush or save: skip the interpreter's teardown (torch's is slow, and the
    # parent's close would wait for it).
    os._exit(0)


def _decode_run(
    backend: LocalDirBackend, buf: ReadBuffer, mem: mmap.mmap, hashes: list[str], fp: str, with_summary: bool
) -> dict:
    """Decodes chunks of `hashes` into `mem` one after another until one fails or does not fit: each
    one's KV, then its summary if `with_summary` (else no room is taken and "summary_at" is null)."""
    chunks: list[dict] = []
    error = None
    at = 0
    for h in hashes:
        try:
            raw = backend.get(h, MAX_FILE_BYTES, buf, HEADER_SIZE, partial(parse_header, chunk_hash=h))
            head = parse_header(raw, len(raw), h)
            held = held_shape(head.dtype, head.shape)
            kv_bytes = int(np.prod(held)) * head.dtype.itemsize
            sum_at = at + kv_bytes
            end = sum_at + (4 * int(np.prod(head.summary_shape)) if with_summary else 0)
            if end > len(mem):
                break
            n = kv_bytes // head.dtype.itemsize
            out = torch.frombuffer(mem, dtype=head.dtype, count=n, offset=at).view(held)
            blob = decode_chunk(raw, h, fp, out=out, stored_crc=False, with_summary=with_summary)
        except errors.ChunkError as e:
            error = {"type": type(e).__name__, "hash": e.chunk_hash, "reason": e.reason}
            break
        except Exception as e:  # a bug, not damage: the parent reads the run itself
            error = {"type": type(e).__name__, "hash": h, "reason": str(e)}
            break
        if blob.summary is not None:
            summary = blob.summary.numpy().reshape(-1)
            np.copyto(np.frombuffer(mem, "<f4", summary.size, sum_at), summary)
        chunks.append(
            {
                "index": blob.index,
                "hash": h,
                "parent": blob.parent_hash,
                "tokens": blob.tokens,
                "dtype": DTYPE_CODES[head.dtype],
                "shape": list(head.shape),
                "kv_at": at,
                "summary_shape": list(head.summary_shape),
                "summary_at": None if blob.summary is None else sum_at,
            }
        )
        at = end + (-end % 64)
    return {"chunks": chunks, "error": error}


def _encode_write(backend: LocalDirBackend, mem: mmap.mmap, msg: dict) -> dict:
    """Encodes the chunk the parent put into `mem` and writes its file: its index row, or the error."""
    try:
        dtype, shape = DTYPES_BY_CODE[msg["dtype"]], tuple(msg["shape"])
        kv = torch.frombuffer(mem, dtype=dtype, count=int(np.prod(shape)), offset=0).view(shape)
        n_sum = int(np.prod(msg["summary_shape"]))
        summary = torch.frombuffer(mem, dtype=torch.float32, count=n_sum, offset=msg["summary_at"])
        summary = summary.view(msg["summary_shape"])
        blob = ChunkBlob(msg["fp"], msg["index"], msg["hash"], msg["parent"], msg["tokens"], summary, kv)
        head, payload, h = encode_chunk(blob, Codec(msg["codec"]), msg["level"])
        backend.put(blob.chain_hash, (head, payload))
    except Exception as e:  # a store error the parent raises, or a bug the parent's threads retry
        return {"error": {"type": type(e).__name__, "reason": str(e)}}
    row = ChunkRow.of(h)
    return {"row": {f: getattr(row, f) for f in ROW_FIELDS}}
