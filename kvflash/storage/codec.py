"""Payload codecs for a chunk's KV `[L, 2, Hkv, C, D]`.

- lossless: byte planes (most significant byte of every element, then the next, ...), then zstd. The
  high bytes (sign, exponent) are highly repetitive while the low mantissa bytes are near-random, so
  splitting them lets zstd compress the first and store the second almost for free. On bf16
  SmolLM2 KV of 4K tokens of prose the two planes compress 1.44x, within 2% of what coding each
  element's exponent and its sign and mantissa apart, without context, can reach (1.465x: 2.9 bits
  of exponent, 8 of sign and mantissa); the exponent in a plane of its own, channel-major, gained 1%.
- fp8: e4m3 with one fp32 scale per (layer, K/V, kv-head), then zstd. Lossy; see `fp8_error`. KV
  that is fp8 already (`--kv-dtype fp8`, dtype code 4) is stored in this codec as it is held: its
  scales and bytes, no second rounding.

The "raw" bytes of a codec are what zstd compresses: the planes, or the scales followed by the fp8
bytes. Decoding never allocates more than the raw size the caller validated against the shape.
"""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
import zstandard

DEFAULT_LEVEL = 1
"""zstd level 1, not 3: on byte-plane KV level 1 both compresses better (real SmolLM2 KV 1.33x vs
1.29x, synthetic 1.30x vs 1.27x) and saves and decompresses faster (docs/BENCHMARKS.md: Snapshot
store)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn."""
FP8 = torch.float8_e4m3fn


class Codec(IntEnum):
    LOSSLESS = 1
    FP8 = 2


CODEC_NAMES = {"lossless": Codec.LOSSLESS, "fp8": Codec.FP8}

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, FP8: 4}
DTYPES_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}
_TORCH_UINT = {2: torch.uint16, 4: torch.uint32}


@dataclass(frozen=True)
class Encoded:
    payload: bytes
    raw_len: int
    raw_crc: int


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """zstd contexts are not thread-safe; each thread keeps its own, per level."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def held_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tensor a chunk of KV shape `[L, 2, Hkv, C, D]` is held in: fp8 KV has one more row per
    (layer, K/V, kv-head), whose first 4 bytes are that block's fp32 scale (kvflash/engine/pool.py,
    `slot_shape`)."""
    L, two, H, C, D = shape
    return (L, two, H, C + 1, D) if dtype == FP8 else tuple(shape)


def kv_shape(held: torch.Tensor) -> tuple[int, ...]:
    """The KV shape `[L, 2, Hkv, C, D]` of a chunk held in `held` (inverse of `held_shape`)."""
    L, two, H, rows, D = held.shape
    return (L, two, H, rows - (held.dtype == FP8), D)


def fits(codec: Codec, dtype: torch.dtype) -> bool:
    """Whether a codec stores KV of a dtype: fp8 KV only in the fp8 codec (its scales are part of it)."""
    return dtype != FP8 or codec == Codec.FP8


def raw_size(codec: Codec, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The raw length a codec produces for a shape; the bound every decode is held to."""
    n = math.prod(shape)
    if codec == Codec.LOSSLESS:
        return n * dtype.itemsize
    return 4 * shape[0] * shape[1] * shape[2] + n


def encode(kv: torch.Tensor, codec: Codec, level: int = DEFAULT_LEVEL) -> Encoded:
    """kv as held (`held_shape`); fp8 KV takes the fp8 codec whatever `codec` says."""
    kv = kv.detach().cpu().contiguous()
    if kv.dtype == FP8:
        raw = _fp8_held_raw(kv)
    else:
        raw = _split_planes(kv) if codec == Codec.LOSSLESS else _fp8_raw(kv)
    return Encoded(_compressor(level).compress(raw), len(raw), zlib.crc32(raw))


def decode(
    payload: bytes | memoryview,
    codec: Codec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    raw_len: int,
    raw_crc: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of `encode`. Raises ValueError on any inconsistency, before allocating when it can.

    `out`, a contiguous CPU tensor of this dtype and held shape (say, a host-tier slot), receives the
    KV once every check has passed; decoding into it saves an allocation and a copy."""
    if not fits(codec, dtype):
        raise ValueError(f"codec {codec.name.lower()} does not hold {dtype} KV")
    if raw_len != raw_size(codec, dtype, shape):
        raise ValueError(f"raw length {raw_len} does not fit shape {list(shape)} and dtype {dtype}")
    raw = _scratch("raw", raw_len)
    try:
        frame = zstandard.get_frame_parameters(payload)
        declared = frame.content_size
        if declared != raw_len:
            raise ValueError(f"zstd frame declares {declared} bytes, header says {raw_len}")
        with _decompressor().stream_reader(payload) as reader:
            n = 0
            while n < raw_len and (got := reader.readinto(raw[n:])):
                n += got
            extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    if n != raw_len or extra:
        raise ValueError(f"the zstd frame holds {'more' if extra else n} bytes, expected {raw_len}")
    # zstd checks a frame's own content checksum (XXH64) while decompressing, cheaper than a second
    # pass of crc32 over the raw bytes; frames written before it existed use the header's raw crc.
    if not frame.has_checksum and zlib.crc32(raw) != raw_crc:
        raise ValueError("raw checksum mismatch")
    held = held_shape(dtype, shape)
    if out is None:
        out = torch.empty(held, dtype=dtype)
    assert (out.dtype, tuple(out.shape)) == (dtype, held), "the caller checks `out` against the header"
    assert out.is_contiguous() and out.device.type == "cpu", "the store checks `out` is host memory"
    if dtype == FP8:
        _fp8_held_decode(raw, out)
    elif codec == Codec.LOSSLESS:
        _merge_planes(raw, _as_uint(out))
    else:
        _fp8_decode(raw, out)
    return out


def frame_checksummed(payload: bytes | memoryview) -> bool:
    """Whether the payload's zstd frame declares a content checksum (False if no frame parses)."""
    try:
        return zstandard.get_frame_parameters(payload).has_checksum
    except zstandard.ZstdError:
        return False


def _scratch(name: str, n: int) -> memoryview:
    """A per-thread buffer of n bytes: a fresh chunk-sized buffer per call costs more in page faults
    than the decompression itself. Callers size it from validated lengths (the raw length; the fp8
    gather's index, at most 2 MiB)."""
    bufs = _local.__dict__.setdefault("scratch", {})
    buf = bufs.get(name)
    if buf is None or len(buf) < n:
        buf = bufs[name] = bytearray(n)
    return memoryview(buf)[:n]


def _split_planes(kv: torch.Tensor) -> memoryview:
    """kv's words as byte planes, most significant first, written by numpy into this thread's
    scratch buffer (a server's store threads encode beside its scheduler: the shifts release the
    interpreter, where a copy of each plane into bytes and their join held it)."""
    size = kv.element_size()
    words = _as_uint(kv)
    raw = _scratch("planes", size * words.size)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(size, -1)
    for j in range(size):  # the narrowing cast keeps each shifted word's low byte
        np.right_shift(words, 8 * (size - 1 - j), out=planes[j], casting="unsafe")
    return raw


def _merge_planes(raw: memoryview, words: np.ndarray) -> None:
    """In place on the output, for the same reason as `_scratch`; a 2-byte dtype takes two passes
    (shift the high plane into the output, or the low one in)."""
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(words.itemsize, -1)
    np.left_shift(planes[0], 8, out=words, dtype=words.dtype)
    words |= planes[1]
    for plane in planes[2:]:
        words <<= 8
        words |= plane


def _as_uint(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned-integer numpy view of a contiguous CPU tensor's bytes, in two torch calls (each
    is a few microseconds under the GIL on a decode thread)."""
    return t.view(_TORCH_UINT[t.element_size()]).numpy().reshape(-1)


# fp8 runs in numpy, through lookup tables: torch's elementwise CPU kernels start an OpenMP team per
# call, and the store calls them from several threads at once.


def _fp8_raw(kv: torch.Tensor) -> bytes:
    x = _as_f32(kv)
    if not np.isfinite(x).all():
        raise ValueError("the fp8 codec needs finite KV; use the lossless codec")
    amax = np.abs(x).max(axis=(3, 4))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype("<f4")
    y = np.clip(x / scale[..., None, None], -FP8_MAX, FP8_MAX)
    q = np.take(_FP8_FROM_BF16, _round_to_bf16_bits(y))
    return scale.tobytes() + q.tobytes()


def _fp8_held_raw(kv: torch.Tensor) -> bytes:
    """fp8 KV as held -> the fp8 codec's raw bytes: its scales (the first 4 bytes of each block's
    last row), then its e4m3 bytes, as they are."""
    blocks = kv.view(torch.uint8).numpy().reshape(-1, kv.shape[-2], kv.shape[-1])
    return blocks[:, -1, :4].tobytes() + blocks[:, :-1].tobytes()


def _fp8_held_decode(raw: memoryview, out: torch.Tensor) -> None:
    """The fp8 codec's raw bytes -> fp8 KV as held (inverse of `_fp8_held_raw`); the rest of each
    scale row is zero."""
    blocks = out.view(torch.uint8).numpy().reshape(-1, out.shape[-2], out.shape[-1])
    n = blocks.shape[0]
    src = np.frombuffer(raw, dtype=np.uint8)
    blocks[:, -1] = 0
    blocks[:, -1, :4] = src[: 4 * n].reshape(n, 4)
    blocks[:, :-1] = src[4 * n :].reshape(n, blocks.shape[1] - 1, blocks.shape[2])


def _fp8_decode(raw: memoryview, out: torch.Tensor) -> None:
    """Each (layer, K/V, kv-head) block gets a 256-entry table of its decoded values (the e4m3 value
    times the block's scale in fp32, rounded once to the output dtype: what decoding element by
    element gives), then the chunk is gathered from the tables: two passes over it, where an fp32
    round trip took about ten over chunk-sized temporaries."""
    shape = tuple(out.shape)
    n_blocks = shape[0] * shape[1] * shape[2]
    scale = np.frombuffer(raw, dtype="<f4", count=n_blocks)
    q = np.frombuffer(raw, dtype=np.uint8, offset=4 * n_blocks).reshape(n_blocks, -1)
    values = _FP8_VALUES * scale[:, None]
    if out.dtype == torch.bfloat16:
        table, dest = _round_to_bf16_bits(values), _as_uint(out)
    else:
        dest = out.numpy().reshape(-1)
        table = values.astype(dest.dtype)
    _gather_blocks(table.reshape(-1), q, dest.reshape(q.shape))


_GATHER_STEP = 1 << 18
"""Elements gathered per step: bounds the index scratch (8 bytes an element) at 2 MiB a thread."""
_INTP = np.dtype(np.intp)


def _gather_blocks(table: np.ndarray, q: np.ndarray, dest: np.ndarray) -> None:
    """dest[b, i] = table[256 * b + q[b, i]]. np.take wants intp indices; building them in a scratch
    buffer saves it a chunk-sized conversion of its own, and mode="clip" (never clipping: every index
    is in range) saves the copy it makes of `out` under the default mode."""
    n_blocks, size = q.shape
    rows, cols = min(n_blocks, max(1, _GATHER_STEP // size)), min(size, _GATHER_STEP)
    index = np.frombuffer(_scratch("index", rows * cols * _INTP.itemsize), dtype=_INTP)
    offsets = np.arange(0, 256 * n_blocks, 256, dtype=_INTP)[:, None]
    for r in range(0, n_blocks, rows):
        for c in range(0, size, cols):
            part = q[r : r + rows, c : c + cols]
            at = index[: part.size].reshape(part.shape)
            np.add(part, offsets[r : r + rows], out=at)
            np.take(table, at, out=dest[r : r + rows, c : c + cols], mode="clip")


def _as_f32(kv: torch.Tensor) -> np.ndarray:
    if kv.dtype == torch.bfloat16:
        bits = kv.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        bits <<= 16
        return bits.view(np.float32)
    return kv.numpy().astype(np.float32, copy=False)


def _round_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (finite input)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def _fp8_tables() -> tuple[np.ndarray, np.ndarray]:
    """(value of each e4m3 byte as fp32, e4m3 byte nearest to each bf16 bit pattern), made once by
    torch's own conversions. bf16 -> e4m3 rounds twice; the extra error is under a bf16 ulp."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    nearest = bf16.float().nan_to_num(0.0).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    by_bits = np.empty(1 << 16, dtype=np.uint8)
    by_bits[bf16.view(torch.int16).numpy().view(np.uint16)] = nearest.view(torch.uint8).numpy()
    return values.numpy(), by_bits


_FP8_VALUES, _FP8_FROM_BF16 = _fp8_tables()


def fp8_error(original: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """Max absolute error over max magnitude, per (layer, K/V, kv-head): `[L, 2, Hkv]`.

    Normalising by the block's max (the quantity the scale is made of) gives a bounded number: e4m3
    keeps 3 mantissa bits, so it stays below 2**-4 (plus the target dtype's rounding)."""
    x = original.detach().cpu().float()
    err = (decoded.detach().cpu().float() - x).abs().amax(dim=(3, 4))
    amax = x.abs().amax(dim=(3, 4))
    return torch.where(amax > 0, err / amax, err)
