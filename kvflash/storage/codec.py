"""Payload codecs for a chunk's KV `[L, 2, Hkv, C, D]`.

- lossless: byte planes (most significant byte of every element, then the next, ...), then zstd. The
  high bytes (sign, exponent) are highly repetitive while the low mantissa bytes are near-random, so
  splitting them lets zstd compress the first and store the second almost for free. fp16 and fp32
  KV are stored so, and bf16 KV was before lossless-bf16 (bf16 SmolLM2 KV, 4K tokens of prose: 1.45x).
- lossless-bf16: each element's exponent as its distance below its channel's largest (a channel
  being one (K/V, layer, kv-head, dim) across the chunk's tokens), in a byte with its sign (flipped
  by its channel's majority sign) and the top 3 mantissa bits; the low 4 mantissa bits of a K and a V
  element share another byte. Exponents cluster per channel (K has outlier channels), so the
  distances take 2.5 bits where pooled exponents take 2.9, and a channel's sign leans one way; zstd's
  Huffman coding sees those skews where it saw none in the planes. Real bf16 KV: 1.53x (planes 1.45x).
- fp8: e4m3 with one fp32 scale per (layer, K/V, kv-head), then zstd. Lossy; see `fp8_error`. KV
  that is fp8 already (`--kv-dtype fp8`, dtype code 4) is stored in this codec as it is held: its
  scales and bytes, no second rounding; only the order of V's bytes changes (`_v_tokens`).

The "raw" bytes of a codec are what zstd compresses: the planes, lossless-bf16's parts, or the scales
followed by the fp8 bytes; each part ends a zstd block. Decoding never allocates more than the raw
size the caller validated against the shape.
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
_FHD_UNUSED = 0x10
"""The unused bit of a zstd frame's header descriptor (the byte after the magic number)."""


class Codec(IntEnum):
    LOSSLESS = 1
    FP8 = 2
    LOSSLESS_BF16 = 3


CODEC_NAMES = {"lossless": Codec.LOSSLESS, "fp8": Codec.FP8}

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, FP8: 4}
DTYPES_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}
_TORCH_UINT = {2: torch.uint16, 4: torch.uint32}


@dataclass(frozen=True)
class Encoded:
    codec: Codec
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
    """Whether a codec stores KV of a dtype: fp8 KV only in the fp8 codec (its scales are part of it),
    lossless-bf16 only bf16."""
    if codec == Codec.LOSSLESS_BF16:
        return dtype == torch.bfloat16
    return dtype != FP8 or codec == Codec.FP8


def stored_as(codec: Codec, dtype: torch.dtype) -> Codec:
    """The codec KV of a dtype is written in when `codec` is asked for: fp8 KV always in fp8, bf16 KV
    asked to be lossless in lossless-bf16."""
    if dtype == FP8:
        return Codec.FP8
    if dtype == torch.bfloat16 and codec == Codec.LOSSLESS:
        return Codec.LOSSLESS_BF16
    return codec if fits(codec, dtype) else Codec.LOSSLESS


def exact(codec: Codec, dtype: torch.dtype) -> bool:
    """Whether KV of a dtype decodes bit for bit from a codec: all but fp8 of wider KV."""
    return codec != Codec.FP8 or dtype == FP8


def raw_bounds(codec: Codec, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    """The least and the largest raw length a codec produces for a shape: the bounds every decode is
    held to. Only lossless-bf16 varies (5 bytes an escaped exponent)."""
    n = math.prod(shape)
    if codec == Codec.LOSSLESS:
        return n * dtype.itemsize, n * dtype.itemsize
    if codec == Codec.LOSSLESS_BF16:
        least = _bf16_fixed_len(shape)
        return least, least + 5 * n
    return (4 * shape[0] * shape[1] * shape[2] + n,) * 2


def encode(
    kv: torch.Tensor, codec: Codec, level: int = DEFAULT_LEVEL, extra: bytes | memoryview = b""
) -> Encoded:
    """kv as held (`held_shape`), in `stored_as(codec, kv.dtype)`. `extra` bytes follow the codec's in
    the raw bytes (a chunk file's summary residual rides in the KV's zstd frame)."""
    kv = kv.detach().cpu().contiguous()
    codec = stored_as(codec, kv.dtype)
    if kv.dtype == FP8:
        parts = [_fp8_held_raw(kv)]
    elif codec == Codec.LOSSLESS_BF16:
        parts = _bf16_parts(kv)
    else:
        parts = [split_planes(kv) if codec == Codec.LOSSLESS else _fp8_raw(kv)]
    parts.append(extra)
    return Encoded(codec, *compress_parts(parts, level))


def compress_parts(parts: list, level: int) -> tuple[bytes, int, int]:
    """(one zstd frame of the parts, raw length, raw crc32). Each part ends a zstd block, so a part
    gets Huffman tables of its own: a block shared by two parts codes both with one table."""
    views = [memoryview(p).cast("B") for p in parts]
    n = sum(len(v) for v in views)
    cobj = _compressor(level).compressobj(size=n)
    out, crc = [], 0
    for p in views:
        if len(p):
            out.append(cobj.compress(p))
            out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
            crc = zlib.crc32(p, crc)
    out.append(cobj.flush())
    return b"".join(out), n, crc


def decode(
    payload: bytes | memoryview,
    codec: Codec,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    raw_len: int,
    raw_crc: int,
    out: torch.Tensor | None = None,
    extra: memoryview | bytearray | None = None,
) -> torch.Tensor:
    """Inverse of `encode`. Raises ValueError on any inconsistency, before allocating when it can.

    `out`, a contiguous CPU tensor of this dtype and held shape (say, a host-tier slot), receives the
    KV once every check has passed; decoding into it saves an allocation and a copy. `extra`
    receives the raw bytes that follow the codec's (`raw_len` counts them)."""
    if not fits(codec, dtype):
        raise ValueError(f"codec {codec.name.lower()} does not hold {dtype} KV")
    n_extra = 0 if extra is None else len(extra)
    least, most = raw_bounds(codec, dtype, shape)
    if not least + n_extra <= raw_len <= most + n_extra:
        raise ValueError(f"raw length {raw_len} does not fit shape {list(shape)} and dtype {dtype}")
    try:
        frame = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    if frame.content_size != raw_len:  # before anything is allocated for raw_len
        raise ValueError(f"zstd frame declares {frame.content_size} bytes, header says {raw_len}")
    raw = _scratch("raw", raw_len)
    try:
        with _decompressor().stream_reader(payload) as reader:
            n = 0
            while n < raw_len and (got := reader.readinto(raw[n:])):
                n += got
            more = reader.read(1)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    if n != raw_len or more:
        raise ValueError(f"the zstd frame holds {'more' if more else n} bytes, expected {raw_len}")
    # The header's raw crc is checked whatever the frame says: zstd checks a frame's own content
    # checksum only once it reaches the frame's end, and the stream reader stops silently where its
    # input ends, so a frame whose block sizes were damaged can yield all raw_len bytes, wrong,
    # without reaching its checksum.
    if zlib.crc32(raw) != raw_crc:
        raise ValueError("raw checksum mismatch")
    held = held_shape(dtype, shape)
    kv_raw = raw[: raw_len - n_extra]
    if codec == Codec.LOSSLESS_BF16:
        escapes = _bf16_escapes(kv_raw, shape)  # checked before `out` is touched
    if out is None:
        out = torch.empty(held, dtype=dtype)
    assert (out.dtype, tuple(out.shape)) == (dtype, held), "the caller checks `out` against the header"
    assert out.is_contiguous() and out.device.type == "cpu", "the store checks `out` is host memory"
    if dtype == FP8:
        _fp8_held_decode(kv_raw, out)
    elif codec == Codec.LOSSLESS_BF16:
        _bf16_decode(kv_raw, escapes, _as_uint(out).reshape(shape))
    elif codec == Codec.LOSSLESS:
        _merge_planes(kv_raw, _as_uint(out))
    else:
        _fp8_decode(kv_raw, out)
    if extra is not None:
        extra[:] = raw[raw_len - n_extra :]
    return out


def unpack_planes(frame: bytes | memoryview, out: torch.Tensor) -> None:
    """A frame of byte planes (`split_planes`) into `out`, a contiguous CPU tensor of the size the
    frame must declare (ValueError otherwise, or on any zstd error). The frame must be as
    `compress_parts` writes it, so that no byte of it goes unchecked: its content checksum declared
    (and so verified), the descriptor bits zstd ignores clear, and nothing after its end (zstd's
    one-shot decompress ignores all three)."""
    n = out.numel() * out.element_size()
    try:
        params = zstandard.get_frame_parameters(frame)
        if params.content_size != n:
            raise ValueError(f"a frame that does not declare {n} bytes")
        if not params.has_checksum or frame[4] & _FHD_UNUSED:
            raise ValueError("a frame header its writer never writes")
        reader = _decompressor().decompressobj()
        raw = reader.decompress(frame)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None
    if len(raw) != n or not reader.eof or reader.unused_data:
        raise ValueError(f"a frame of {len(raw)} bytes, expected {n}, or bytes past its end")
    _merge_planes(memoryview(raw), _as_uint(out))


def _scratch(name: str, n: int) -> memoryview:
    """A per-thread buffer of n bytes: a fresh chunk-sized buffer per call costs more in page faults
    than the decompression itself. Callers size it from validated lengths (the raw length; the fp8
    gather's index, at most 2 MiB; lossless-bf16's tiled channels, 16 bytes a channel)."""
    bufs = _local.__dict__.setdefault("scratch", {})
    buf = bufs.get(name)
    if buf is None or len(buf) < n:
        buf = bufs[name] = bytearray(n)
    return memoryview(buf)[:n]


def split_planes(kv: torch.Tensor) -> memoryview:
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


_SPAN = 15
"""Exponents a head spans below its channel's largest; an element further down is escaped."""


def _bf16_fixed_len(shape: tuple[int, ...]) -> int:
    """lossless-bf16's raw length without escapes: channel exponents and signs, heads, tails."""
    L, two, H, C, D = shape
    channels = L * two * H * D
    return channels + (channels + 7) // 8 + L * two * H * C * D + L * H * C * D


def _bf16_parts(kv: torch.Tensor) -> list[np.ndarray]:
    """bf16 KV `[L, 2, Hkv, C, D]` as lossless-bf16's parts (docs/FORMAT.md: Codecs): channel
    exponents, channel signs, heads, tails, escapes. A head is the element's sign flipped by its
    channel's, then 15 - (channel exponent - exponent) (0: escaped), then mantissa bits 6-4.

    A word's bits 4-11 narrowed to a byte hold its low 5 exponent bits over those mantissa bits;
    adding `(15 - channel exponent) << 3` (mod 256) leaves the field in bits 3-6 and 0 in bit 7
    wherever the field is 1-15, the channel's sign added at bit 7 flips it, and the element's sign
    XORed in completes the head; escaped heads, a few, are written afterwards. Every pass over the
    chunk is a narrowing or an in-place one that numpy vectorises: the per-channel operand tiled
    over a few tokens, a multiply for a shift left, and reductions over tokens by halving."""
    x = _as_uint(kv).reshape(kv.shape)
    L, two, H, C, D = x.shape
    e = np.empty(x.shape, dtype=np.uint8)
    np.right_shift(x, 7, out=e, casting="unsafe")  # the narrowing drops the sign
    ref = _fold_tokens(e, np.maximum, np.uint8)
    signs = np.empty(x.shape, dtype=np.uint8)
    np.right_shift(x, 15, out=signs, casting="unsafe")
    majority = _fold_tokens(signs, np.add, np.min_scalar_type(C)) > C // 2
    rows = math.gcd(C, 8)
    tiled = (L, two, H, C // rows, rows * D)
    below = np.less(e.reshape(tiled), _tile(np.maximum(ref, 14) - 14, rows), out=e.view(bool).reshape(tiled))
    escaped = np.flatnonzero(below).astype("<u4")
    heads = np.empty(x.shape, dtype=np.uint8)
    np.right_shift(x, 4, out=heads, casting="unsafe")
    base = (np.uint8(_SPAN) - ref) * np.uint8(8) + majority * np.uint8(0x80)
    heads.reshape(tiled)[...] += _tile(base, rows)
    heads ^= np.multiply(signs, 0x80, out=signs)
    tails = np.empty(x[:, 0].shape, dtype=np.uint8)
    np.left_shift(x[:, 0], 4, out=tails, casting="unsafe")  # the narrowing keeps bits 0-3 as 4-7
    nibbles = np.bitwise_and(x[:, 1], 15, out=np.empty_like(tails), casting="unsafe")
    tails |= nibbles
    words = x.reshape(-1)[escaped]
    token_rows, d = np.divmod(escaped, D)
    flipped = majority.reshape(-1)[token_rows // C * D + d].astype(np.uint16) << 15
    heads.reshape(-1)[escaped] = ((words ^ flipped) >> 8 & 0x80 | words >> 4 & 7).astype(np.uint8)
    exponents = (words >> 7 & 0xFF).astype(np.uint8)
    return [ref.reshape(-1), np.packbits(majority), heads.reshape(-1), tails.reshape(-1), escaped, exponents]


def _fold_tokens(a: np.ndarray, ufunc: np.ufunc, dtype: np.dtype) -> np.ndarray:
    """`ufunc` reduced over the tokens of `a` `[L, 2, Hkv, C, D]` into `dtype`, `[L, 2, Hkv, 1, D]`,
    by halving the rows: numpy's own reduce over that axis runs one row of D at a time."""
    c = a.shape[3]
    half = c // 2
    acc = np.empty((*a.shape[:3], c - half, a.shape[4]), dtype=dtype)
    acc[..., half:, :] = a[..., half : c - half, :]  # an odd C's middle row
    ufunc(a[..., :half, :], a[..., c - half :, :], out=acc[..., :half, :], dtype=dtype)
    c -= half
    while c > 1:
        half = c // 2
        ufunc(acc[..., :half, :], acc[..., c - half : c, :], out=acc[..., :half, :])
        c -= half
    return np.ascontiguousarray(acc[..., :1, :])


def _tile(channels: np.ndarray, rows: int) -> np.ndarray:
    """A per-channel `[L, 2, Hkv, 1, D]` array repeated over `rows` tokens, as one row of `rows * D`:
    a broadcast against the chunk's rows of that length runs long inner loops. It lives in this
    thread's scratch, valid until the next call."""
    L, two, H, _, D = channels.shape
    out = np.frombuffer(
        _scratch("tiled", channels.nbytes * rows), dtype=channels.dtype, count=channels.size * rows
    )
    out = out.reshape(L, two, H, rows, D)
    np.copyto(out, channels)
    return out.reshape(L, two, H, 1, rows * D)


def _bf16_escapes(raw: memoryview, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(positions, exponents) of the escaped elements: the raw bytes past the fixed parts hold 5 a
    position (u32 each, then a byte each), every position inside the chunk."""
    fixed, n = _bf16_fixed_len(shape), math.prod(shape)
    k, rest = divmod(len(raw) - fixed, 5)
    if rest:
        raise ValueError(f"{len(raw) - fixed} bytes of escapes, not 5 an escape")
    at = np.frombuffer(raw, dtype="<u4", count=k, offset=fixed)
    if k and int(at.max()) >= n:
        raise ValueError(f"an escaped position {int(at.max())} past the chunk's {n} elements")
    return at, np.frombuffer(raw, dtype=np.uint8, count=k, offset=fixed + 4 * k)


def _bf16_decode(raw: memoryview, escapes: tuple[np.ndarray, np.ndarray], words: np.ndarray) -> None:
    """lossless-bf16's raw bytes -> the words `[L, 2, Hkv, C, D]` (inverse of `_bf16_parts`).

    A head copied as int8 into an int16 sign-extends, so its sign fills bits 7-15. Times 16 (V), or
    times 256 under the tail byte and back right 4 (K, whose tail nibble is the byte's high half),
    its distance field and top mantissa bits stand at the exponent's and the mantissa's places, and
    masking bits 11-14 leaves the sign at bit 15. Adding `(channel exponent - 15) << 7` (mod 2**16)
    then makes the exponent; the channel's sign is in that base. Every step is an in-place pass that
    numpy vectorises: multiplies where shifts left are not, and the base tiled over a few tokens so
    that its broadcast add runs long rows."""
    L, two, H, C, D = words.shape
    channels = L * two * H * D
    src = np.frombuffer(raw, dtype=np.uint8)
    at = channels + (channels + 7) // 8
    refs = src[:channels].reshape(L, two, H, 1, D).astype(np.uint16)
    signs = np.unpackbits(src[channels:at], count=channels).reshape(L, two, H, 1, D).astype(np.uint16)
    heads = src[at : at + words.size].reshape(words.shape).view(np.int8)
    tails = src[at + words.size : at + words.size + words.size // 2].reshape(L, H, C, D)
    signed = words.view(np.int16)
    np.copyto(signed, heads)
    k, v = signed[:, 0], signed[:, 1]
    k *= 256
    k |= tails
    k >>= 4
    v *= 16
    words &= 0x87FF
    nibbles = np.frombuffer(_scratch("nibbles", tails.size), dtype=np.uint8).reshape(tails.shape)
    words[:, 1] |= np.bitwise_and(tails, 15, out=nibbles)
    rows = math.gcd(C, 8)
    tiled = words.reshape(L, two, H, C // rows, rows * D)
    tiled += _tile(((refs - np.uint16(_SPAN)) << 7) ^ (signs << 15), rows)
    positions, exponents = escapes
    if positions.size:
        # the base wrapped below 0 flipped the sign; adding 15 << 7 back restores it
        flat = words.reshape(-1)
        kept = (flat[positions] + np.uint16(_SPAN << 7)) & 0x807F
        flat[positions] = kept | (exponents.astype(np.uint16) << 7)


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


def _v_tokens(blocks: np.ndarray, c: int, d: int) -> np.ndarray:
    """Held fp8 V blocks, each a run of (C + 1) x D bytes `[..., (C + 1) * D]`, as a view `[..., C, D]`
    of their e4m3 bytes in token order. A held V block is channel-major, token t of channel d at byte
    d * C + t (the kernels' `_common.fp8_v_tokens`, of which this is the numpy twin: storage imports
    no other layer); a file holds V in token order, as K, as it did before V was held so."""
    return blocks[..., : c * d].reshape(*blocks.shape[:-1], d, c).swapaxes(-1, -2)


def _fp8_held_raw(kv: torch.Tensor) -> np.ndarray:
    """fp8 KV as held -> the fp8 codec's raw bytes: its scales (the first 4 bytes of each block's
    last row), then its e4m3 bytes `[L, 2, Hkv, C, D]` in token order (`_v_tokens`)."""
    L, two, H, rows, D = kv.shape
    n, c = L * two * H, rows - 1
    blocks = kv.view(torch.uint8).numpy().reshape(L, two, H, rows * D)
    raw = np.empty(4 * n + n * c * D, dtype=np.uint8)
    raw[: 4 * n].reshape(L, two, H, 4)[...] = blocks[..., c * D : c * D + 4]
    body = raw[4 * n :].reshape(L, two, H, c, D)
    body[:, 0] = blocks[:, 0, :, : c * D].reshape(L, H, c, D)
    body[:, 1] = _v_tokens(blocks[:, 1], c, D)
    return raw


def _fp8_held_decode(raw: memoryview, out: torch.Tensor) -> None:
    """The fp8 codec's raw bytes -> fp8 KV as held (inverse of `_fp8_held_raw`); the rest of each
    scale row is zero."""
    L, two, H, rows, D = out.shape
    n, c = L * two * H, rows - 1
    blocks = out.view(torch.uint8).numpy().reshape(L, two, H, rows * D)
    src = np.frombuffer(raw, dtype=np.uint8)
    body = src[4 * n :].reshape(L, two, H, c, D)
    blocks[..., c * D :] = 0
    blocks[..., c * D : c * D + 4] = src[: 4 * n].reshape(L, two, H, 4)
    blocks[:, 0, :, : c * D] = body[:, 0].reshape(L, H, c * D)
    _v_tokens(blocks[:, 1], c, D)[...] = body[:, 1]


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


def key_values(kv: torch.Tensor) -> np.ndarray:
    """The keys of a chunk as held (`held_shape`), as fp32 values `[L, Hkv, C, D]`: exact for 16-bit
    and fp32 KV; for fp8 each byte's value times its block's scale, as the engine reads them."""
    if kv.dtype != FP8:
        return _as_f32(kv[:, 0].contiguous())
    blocks = kv[:, 0].view(torch.uint8).numpy()
    scale = np.ascontiguousarray(blocks[:, :, -1, :4]).view("<f4")  # [L, Hkv, 1]
    return _FP8_VALUES[blocks[:, :, :-1]] * scale[..., None]


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
