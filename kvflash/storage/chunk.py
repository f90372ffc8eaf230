"""A chunk as the store sees it, and the chain hash that names it (docs/DESIGN.md: Units)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvflash.storage.errors import InvalidChunk, InvalidName
from kvflash.storage.names import check_fingerprint, check_hash

ROOT_HASH = "0" * 64
"""The parent of chunk 0."""

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def token_bytes(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """Token ids as little-endian int32, the form hashed and stored."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidChunk("token ids must be a flat sequence of integers")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**31):
        raise InvalidChunk("token ids must lie in [0, 2**31)")
    return arr.astype("<i4").tobytes()


def chain_hash(parent_hash: bytes | str, fingerprint: str, tokens: Sequence[int]) -> str:
    """h_i = sha256(h_{i-1} | len(fingerprint) | fingerprint | tokens as int32le), as 64 hex digits.

    The length prefix keeps the fingerprint/tokens boundary unambiguous."""
    parent = bytes.fromhex(check_hash(parent_hash)) if isinstance(parent_hash, str) else bytes(parent_hash)
    if len(parent) != 32:
        raise InvalidName("a parent hash is 32 bytes (64 hex digits)")
    return chain_digest(parent, check_fingerprint(fingerprint), token_bytes(tokens))


def chain_digest(parent: bytes, fingerprint: str, tokens_le32: bytes | memoryview) -> str:
    """`chain_hash` of already validated parts (a reader hashes the token bytes it read)."""
    fp = fingerprint.encode()
    h = hashlib.sha256(parent)
    h.update(len(fp).to_bytes(2, "little"))
    h.update(fp)
    h.update(tokens_le32)
    return h.hexdigest()


def chain_hashes(
    fingerprint: str, tokens: Sequence[int], chunk_tokens: int, parent: str = ROOT_HASH
) -> list[str]:
    """The chain hash of every full chunk of a token sequence (the partial tail has none), the first
    chunk's parent being `parent` (a chain continued from its last known hash). The tokens are
    checked and converted once and the digests chained as bytes: per chunk, `chain_hash` spent
    most of its time re-checking its arguments."""
    n = len(tokens) // chunk_tokens
    if not n:
        return []
    raw = token_bytes(tokens[: n * chunk_tokens])
    fp = check_fingerprint(fingerprint).encode()
    prefix = len(fp).to_bytes(2, "little") + fp
    step = 4 * chunk_tokens
    out, digest = [], bytes.fromhex(check_hash(parent))
    for i in range(n):
        h = hashlib.sha256(digest)
        h.update(prefix)
        h.update(raw[i * step : (i + 1) * step])
        digest = h.digest()
        out.append(digest)
    return [d.hex() for d in out]


@dataclass
class ChunkBlob:
    """One full, final chunk: its tokens, key summary and KV `[L, 2, Hkv, C, D]` (on any device; fp8
    KV as held, with a scale row: `codec.held_shape`)."""

    fingerprint: str
    index: int
    chain_hash: str
    parent_hash: str
    # Out of the repr: formatting a chunk's tensors is slow, and a blob is formatted wherever one
    # appears in a log line, a warning or a task's repr.
    tokens: list[int] = field(repr=False)
    summary: torch.Tensor | None = field(repr=False)
    """[L, Hkv, B, D] fp32: the mean key of each of B equal runs of the chunk's tokens (B divides C).
    None where the chunk was read without it (`with_summary=False`: a restore takes its summaries
    from the summaries file); a chunk to save needs one."""
    kv: torch.Tensor = field(repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @classmethod
    def build(
        cls,
        fingerprint: str,
        index: int,
        parent_hash: str,
        tokens: Sequence[int],
        summary: torch.Tensor,
        kv: torch.Tensor,
    ) -> ChunkBlob:
        """A blob whose chain hash is computed from its parent and tokens."""
        tokens = [int(t) for t in tokens]
        return cls(
            fingerprint, index, chain_hash(parent_hash, fingerprint, tokens), parent_hash, tokens, summary, kv
        )

    def check(self) -> None:
        """Shapes, dtypes and chain hash agree (the summary's where there is one); raises InvalidChunk
        otherwise."""
        kv, s = self.kv, self.summary
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise InvalidChunk(f"chunk {self.index}: kv must be [L, 2, Hkv, C, D], got {tuple(kv.shape)}")
        if kv.dtype not in KV_DTYPES:
            raise InvalidChunk(f"chunk {self.index}: kv dtype {kv.dtype} is not bf16, fp16, fp32 or fp8")
        L, _, H, C, D = kv.shape
        C -= kv.dtype == torch.float8_e4m3fn  # its last row holds the scales
        if len(self.tokens) != C:
            raise InvalidChunk(f"chunk {self.index}: {len(self.tokens)} tokens for a {C}-token chunk")
        if s is not None:
            if s.dtype != torch.float32 or s.dim() != 4 or (s.shape[0], s.shape[1], s.shape[3]) != (L, H, D):
                raise InvalidChunk(
                    f"chunk {self.index}: summary must be fp32 [{L}, {H}, B, {D}], "
                    f"got {s.dtype} {tuple(s.shape)}"
                )
            B = s.shape[2]
            if B < 1 or C % B:
                raise InvalidChunk(f"chunk {self.index}: {B} summary blocks do not divide a {C}-token chunk")
        if self.chain_hash != chain_hash(self.parent_hash, self.fingerprint, self.tokens):
            raise InvalidChunk(f"chunk {self.index}: chain hash does not match parent, fingerprint, tokens")


@dataclass
class ChunkSummary:
    """A stored chunk without its KV: what a lazy, query-aware restore reads first."""

    index: int
    chain_hash: str
    parent_hash: str
    tokens: list[int]
    summary: torch.Tensor
    """[L, Hkv, B, D] fp32, as in ChunkBlob."""
