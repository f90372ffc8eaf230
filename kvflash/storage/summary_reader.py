"""`SummaryReader`: chunks' token ids and key summaries without their KV, which a lazy restore and a
lookup of stored documents read up front.

They come from one summaries file (kvflash/storage/summaries.py) where a snapshot's chain starts with
the chunks asked for, else from each chunk file: its token and summary sections, or (version 3) its
token ids and whole payload, decoded. A summaries file only ever spares reads: one that is missing
or fails a check marks nothing, and the chunk files answer instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflash.storage.chunk import ROOT_HASH, ChunkSummary
from kvflash.storage.chunk_reader import ChunkReader
from kvflash.storage.context import StoreContext
from kvflash.storage.errors import ChunkCorrupt, ChunkError
from kvflash.storage.format import HEADER_SIZE, check_identity, decode_meta, parse_header
from kvflash.storage.names import check_hash
from kvflash.storage.summaries import (
    NATIVE,
    SUMMARIES_HEADER_SIZE,
    HeadRead,
    check_summaries_file,
    parse_summaries_header,
)
from kvflash.storage.summaries import check_identity as check_summaries_identity

SUMMARIES_TRIES = 3
"""Summaries files a read tries (of the snapshots through its prefix, shortest chain first) before
it reads per chunk: each miss costs a read, and a store written before summaries files has none."""


class SummaryReader:
    def __init__(self, ctx: StoreContext, chunks: ChunkReader):
        self.backend, self.index, self.threads = ctx.backend, ctx.index, ctx.threads
        self.chunks = chunks
        self._meta_len_hint = 0

    def read_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        """Token ids and key summaries without the KV: from one summaries file where a snapshot's
        chain starts with `hashes` (`chain_summaries`), else from each chunk file
        (`chunk_summaries`). `out`, contiguous fp32 `[len(hashes), L, Hkv, B, D]` on
        the CPU, receives the summaries in order."""
        if out is not None:
            assert out.dtype == torch.float32 and out.device.type == "cpu" and len(out) == len(hashes)
            assert out.is_contiguous()
        self.chunks.check_rows(hashes, expect_fingerprint)
        got = self.chain_summaries(hashes, expect_fingerprint, out)
        return got if got is not None else self._chunk_summaries(hashes, expect_fingerprint, out)

    def chain_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary] | None:
        """`read_summaries` of chunks 0..n-1 of a chain from the summaries file of a snapshot whose
        chain starts with them (the index names it): one read, straight into `out`. None where no
        file serves (none stored, damaged, of another shape): the caller reads per chunk. The file
        is checked on its own (its checksums, and its token ids must give `hashes`), so a bad one
        marks nothing in the index."""
        if not hashes or not NATIVE:
            return None
        for last in self.index.chains_through(check_hash(hashes[-1]), len(hashes) - 1)[:SUMMARIES_TRIES]:
            try:
                return self._read_head(last, hashes, expect_fingerprint, out)
            except ChunkError:
                continue
        return None

    def _read_head(
        self, last: str, hashes: Sequence[str], fp: str, out: torch.Tensor | None
    ) -> list[ChunkSummary]:
        read = HeadRead(last, fp, hashes, out)
        self.backend.get_summaries(last, read.head_len, read.plan)
        tokens = read.check_tokens()
        n_runs = min(len(hashes), self.threads.n)
        bounds = [len(hashes) * i // n_runs for i in range(n_runs + 1)]
        self.threads.map(lambda i: read.check_entries(bounds[i], bounds[i + 1]), n_runs)
        parents = [ROOT_HASH, *hashes[:-1]]
        return [ChunkSummary(i, h, parents[i], tokens[i], read.rows[i]) for i, h in enumerate(hashes)]

    def stored_frames(self, hashes: Sequence[str], expect_fingerprint: str) -> HeadRead | None:
        """The first len(hashes) entries of a version 2 summaries file whose chain starts with
        `hashes`, as stored: tables and token ids checked (as `chain_summaries` checks them), frames
        not decoded. A save of a chain that extends them copies them instead of compressing the
        same summaries again; each frame keeps zstd's checksum of its content, which every reader of
        the new file checks. None where no such file serves."""
        if not hashes or not NATIVE:
            return None
        for last in self.index.chains_through(check_hash(hashes[-1]), len(hashes) - 1)[:SUMMARIES_TRIES]:
            read = HeadRead(last, expect_fingerprint, hashes, None, frames_only=True)
            try:
                self.backend.get_summaries(last, read.head_len, read.plan)
                read.check_tokens()
            except ChunkError:
                continue
            return read
        return None

    def chunk_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None = None
    ) -> list[ChunkSummary]:
        """`read_summaries` from each chunk file's token and summary sections. Header and
        token/summary checksums are verified here; the payload's when its chunk is read."""
        self.chunks.check_rows(hashes, expect_fingerprint)
        return self._chunk_summaries(hashes, expect_fingerprint, out)

    def _chunk_summaries(
        self, hashes: Sequence[str], expect_fingerprint: str, out: torch.Tensor | None
    ) -> list[ChunkSummary]:
        def one(i: int) -> ChunkSummary:
            return self._load_summary(hashes[i], expect_fingerprint, None if out is None else out[i])

        return self.threads.map(one, len(hashes))

    def _load_summary(self, h: str, fp: str, out: torch.Tensor | None = None) -> ChunkSummary:
        try:
            # One read for header and sections: the chunks of a sequence share one shape, so the
            # last chunk's section length predicts this one's (a second read covers a miss).
            buf, size = self.backend.get_range(h, 0, HEADER_SIZE + self._meta_len_hint)
            header = parse_header(buf, size, h)
            check_identity(header, h, fp)
            end = HEADER_SIZE + header.meta_len
            if len(buf) < end:
                more, _ = self.backend.get_range(h, len(buf), end - len(buf))
                buf += more
            self._meta_len_hint = end - HEADER_SIZE
            tokens, summary = decode_meta(header, memoryview(buf)[HEADER_SIZE:end], h, out)
        except ChunkError as e:
            self.chunks.mark(e)
            raise
        if summary is None:  # version 3: the summary comes back with the KV
            summary = self.chunks.load(h, fp=fp).summary
            if out is not None:
                summary = out.copy_(summary)
        return ChunkSummary(header.index, h, header.parent_hash, tokens, summary)

    def has_summaries(self, fp: str, hashes: Sequence[str]) -> bool:
        """Whether a summaries file of exactly this chain is stored (by its header alone)."""
        last, n = check_hash(hashes[-1]), len(hashes)

        def plan(head: memoryview, size: int) -> list:
            h = parse_summaries_header(head, size, last)
            check_summaries_identity(h, last, fp, n)
            if h.n_chunks != n:
                raise ChunkCorrupt(last, f"{h.n_chunks} chunks for a chain of {n}")
            return []

        try:
            self.backend.get_summaries(last, SUMMARIES_HEADER_SIZE, plan)
        except ChunkError:
            return False
        return True

    def summaries_file(self, fp: str, hashes: Sequence[str]) -> bytearray:
        """The summaries file of a chain as stored, every check passed (all its entries, of exactly
        this chain): what `verify` checks and a copy to another store sends."""
        last = check_hash(hashes[-1])
        got: list[bytearray] = []

        def plan(head: memoryview, size: int) -> list[tuple[int, memoryview]]:
            parse_summaries_header(head, size, last)  # its sizes checked before the file is read
            got.append(bytearray(size))
            return [(0, memoryview(got[0]))]

        self.backend.get_summaries(last, SUMMARIES_HEADER_SIZE, plan)
        check_summaries_file(got[0], last, fp, hashes)
        return got[0]
