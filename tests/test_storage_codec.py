"""The chunk codecs: lossless byte planes and fp8 blocks, bit-exact or within their stated error, and frames
that are refused when they do not add up."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
import zstandard

from kvflash import kernels
from kvflash.storage import (
    codec,
)
from kvflash.storage.codec import Codec
from kvflash.storage.key_means import key_means
from tests.store_util import (
    DTYPES,
    H,
    L,
    bits,
    kv_for,
    toks,
)

# codecs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", [1, 3])
def test_lossless_codec_is_bit_exact(dtype, level) -> None:
    kv = kv_for(toks(1), dtype)
    flat = kv.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 0.0]).to(dtype)
    enc = codec.encode(kv, Codec.LOSSLESS, level)
    assert enc.codec == (Codec.LOSSLESS_BF16 if dtype == torch.bfloat16 else Codec.LOSSLESS)
    out = codec.decode(enc.payload, enc.codec, dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)
    assert out.dtype == dtype and torch.equal(bits(out), bits(kv))


def _bf16(words: torch.Tensor) -> torch.Tensor:
    return words.to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    [
        "every pattern",
        "random bits",
        "one channel spans every exponent",
        "signs one way",
        "zeros",
        "odd shape",
    ],
)
def test_lossless_bf16_is_bit_exact_on_adversarial_kv(case) -> None:
    """Every bf16 bit pattern (NaNs, infinities, subnormals, -0), channels whose exponents lie
    further apart than a head spans (escapes), all-one signs and odd axes come back bit for bit."""
    g = torch.Generator().manual_seed(0)
    shape = {"every pattern": (4, 2, 2, 64, 64), "odd": (3, 2, 1, 5, 3)}.get(case, (2, 2, 3, 16, 8))
    n = math.prod(shape)
    words = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32)
    if case == "every pattern":
        words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32)
    elif case == "one channel spans every exponent":
        words = torch.randint(0, 1 << 7, (n,), generator=g, dtype=torch.int32)
        words[:: shape[-1]] |= torch.arange(0, n, shape[-1]) % 256 << 7  # channel 0: exponents 0..255
    elif case == "signs one way":
        words = torch.randint(0, 1 << 15, (n,), generator=g, dtype=torch.int32) | -(1 << 15)
    elif case == "zeros":
        words = torch.zeros(n, dtype=torch.int32)
    kv = _bf16(words).reshape(shape)
    enc = codec.encode(kv, Codec.LOSSLESS)
    assert enc.codec == Codec.LOSSLESS_BF16
    out = codec.decode(enc.payload, enc.codec, kv.dtype, shape, enc.raw_len, enc.raw_crc)
    assert torch.equal(bits(out), bits(kv))


def test_lossless_bf16_escapes_an_exponent_15_below_its_channels_largest() -> None:
    """A channel's exponents 0..14 below its largest are in the heads; 15 and more below, each
    costs one escape (5 raw bytes)."""
    shape = (1, 2, 1, 4, 1)
    exps = torch.tensor([130, 116, 115, 0, 130, 130, 130, 130])  # K: 0, 14, 15 and 130 below 130
    kv = _bf16(exps << 7 | 0x55).reshape(shape)
    enc = codec.encode(kv, Codec.LOSSLESS)
    assert enc.raw_len == codec.raw_bounds(Codec.LOSSLESS_BF16, kv.dtype, shape)[0] + 2 * 5
    out = codec.decode(enc.payload, enc.codec, kv.dtype, shape, enc.raw_len, enc.raw_crc)
    assert torch.equal(bits(out), bits(kv))


def test_lossless_bf16_decodes_raw_bytes_as_the_format_describes() -> None:
    """Raw parts written by hand (docs/FORMAT.md: Codecs), every head byte that is not an escape and
    every tail byte, decode to the words the format defines, independently of the encoder."""
    g = torch.Generator().manual_seed(1)
    shape = (2, 2, 3, 240, 4)
    L_, _, H_, C, D = shape
    n_ch = L_ * 2 * H_ * D
    refs = torch.randint(14, 256, (L_, 2, H_, 1, D), generator=g)  # 15 - field below: never under 0
    signs = torch.randint(0, 2, (L_, 2, H_, 1, D), generator=g)
    unescaped = torch.tensor([h for h in range(256) if (h >> 3) & 15])
    spread = torch.arange(C)[:, None] + 17 * torch.arange(D) + 5 * torch.arange(2 * H_ * L_)[:, None, None]
    heads = unescaped[spread % len(unescaped)].reshape(L_, 2, H_, C, D)
    tails = torch.randint(0, 256, (L_, H_, C, D), generator=g)
    nibbles = torch.stack([tails >> 4, tails & 15], dim=1)
    exponent = refs - 15 + ((heads >> 3) & 15)
    words = ((heads >> 7) ^ signs) << 15 | exponent << 7 | (heads & 7) << 4 | nibbles
    packed = np.packbits(signs.reshape(-1).numpy().astype(np.uint8)).tobytes()
    raw = b"".join(t.reshape(-1).to(torch.uint8).numpy().tobytes() for t in (refs, heads, tails))
    raw = raw[:n_ch] + packed + raw[n_ch:]
    assert len(raw) == codec.raw_bounds(Codec.LOSSLESS_BF16, torch.bfloat16, shape)[0]
    payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    out = codec.decode(payload, Codec.LOSSLESS_BF16, torch.bfloat16, shape, len(raw), zlib.crc32(raw))
    assert torch.equal(out.view(torch.int16).to(torch.int32) & 0xFFFF, words)


def _bf16_reference_parts(kv: torch.Tensor) -> list[bytes]:
    """lossless-bf16's raw parts as docs/FORMAT.md (Codecs) spells them, element by element in int32."""
    w = kv.view(torch.int16).to(torch.int32) & 0xFFFF
    C = w.shape[3]
    e, sign = (w >> 7) & 0xFF, w >> 15
    E = e.amax(dim=3, keepdim=True)
    negative = (sign.sum(dim=3, keepdim=True) * 2 > C).to(torch.int32)
    distance = E - e
    field = torch.where(distance < 15, 15 - distance, 0)
    heads = (sign ^ negative) << 7 | field << 3 | (w >> 4) & 7
    tails = (w[:, 0] & 15) << 4 | w[:, 1] & 15
    escaped = (distance >= 15).reshape(-1).nonzero().reshape(-1)

    def u8(t: torch.Tensor) -> bytes:
        return t.reshape(-1).to(torch.uint8).numpy().tobytes()

    signs = np.packbits(negative.reshape(-1).numpy().astype(np.uint8)).tobytes()
    positions = escaped.numpy().astype("<u4").tobytes()
    return [u8(E), signs, u8(heads), u8(tails), positions, u8(e.reshape(-1)[escaped])]


@pytest.mark.parametrize("shape", [(2, 2, 3, 64, 16), (3, 2, 1, 5, 3), (1, 2, 2, 1, 4), (2, 2, 1, 300, 1)])
def test_lossless_bf16_encodes_the_parts_the_format_describes(shape) -> None:
    """The encoder's raw bytes and frame are those of the parts docs/FORMAT.md defines, built here
    element by element: real-looking KV with outlier channels and escapes, random bits, ties of
    signs, a token or a dim alone, more tokens than a byte counts."""
    g = torch.Generator().manual_seed(2)
    n = math.prod(shape)
    outliers = torch.exp(2 * torch.randn(shape[:3] + (1, shape[4]), generator=g))
    odd_tokens = torch.arange(shape[3]).reshape(1, 1, 1, -1, 1) % 2
    kvs = [
        (torch.randn(shape, generator=g) * outliers * torch.exp(torch.randn(shape, generator=g))).bfloat16(),
        _bf16(torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32)).reshape(shape),
        _bf16((0x3F80 | odd_tokens << 15).expand(shape)),
    ]
    for kv in kvs:
        enc = codec.encode(kv, Codec.LOSSLESS, extra=b"residual")
        parts = _bf16_reference_parts(kv) + [b"residual"]
        assert zstandard.ZstdDecompressor().decompress(enc.payload) == b"".join(parts)
        assert (enc.payload, enc.raw_len, enc.raw_crc) == codec.compress_parts(parts, codec.DEFAULT_LEVEL)


def test_lossless_bf16_refuses_escapes_that_do_not_add_up() -> None:
    shape = (1, 2, 1, 4, 2)
    least = codec.raw_bounds(Codec.LOSSLESS_BF16, torch.bfloat16, shape)[0]
    for raw, match in (
        (bytes(least + 3), "not 5 an escape"),
        (bytes(least) + (1 << 20).to_bytes(4, "little") + b"\x80", "past the chunk"),
    ):
        payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
        with pytest.raises(ValueError, match=match):
            codec.decode(payload, Codec.LOSSLESS_BF16, torch.bfloat16, shape, len(raw), zlib.crc32(raw))


def test_lossless_bf16_holds_only_bf16() -> None:
    assert not codec.fits(Codec.LOSSLESS_BF16, torch.float16)
    assert codec.stored_as(Codec.LOSSLESS, torch.float16) == Codec.LOSSLESS
    with pytest.raises(ValueError, match="does not hold"):
        codec.decode(b"", Codec.LOSSLESS_BF16, torch.float16, (1, 2, 1, 1, 1), 1, 0)


def test_the_old_lossless_codec_still_decodes_bf16() -> None:
    """Chunk files before lossless-bf16 hold bf16 KV in byte planes (codec 1)."""
    kv = kv_for(toks(1))
    raw = bytes(codec.split_planes(kv))
    payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    out = codec.decode(payload, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), len(raw), zlib.crc32(raw))
    assert torch.equal(bits(out), bits(kv))


def test_byte_planes_put_high_bytes_first() -> None:
    kv = torch.tensor([0x1234, 0x5678], dtype=torch.int16).view(torch.float16).reshape(1, 2, 1, 1, 1)
    assert codec.split_planes(kv) == bytes([0x12, 0x56, 0x34, 0x78])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_error_is_reported_and_bounded(dtype) -> None:
    kv = kv_for(toks(1), dtype)
    kv[1, 0, 1] = 0  # an all-zero block keeps scale 1 and decodes to zeros
    kv[0, 1, 0] *= 1000  # blocks of very different magnitude each get their own scale
    enc = codec.encode(kv, Codec.FP8)
    assert enc.raw_len == codec.raw_bounds(Codec.FP8, dtype, tuple(kv.shape))[0]
    out = codec.decode(enc.payload, Codec.FP8, dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)
    err = codec.fp8_error(kv, out)
    assert err.shape == (L, 2, H)
    assert float(err.max()) <= 2**-4 + 2**-7, err  # e4m3 rounding plus the target dtype's
    assert float(err.max()) > 0 and torch.count_nonzero(out[1, 0, 1]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", [1 << 18, 5], ids=["one-step", "steps-inside-blocks"])
def test_fp8_decodes_each_byte_times_its_block_scale_rounded_once(dtype, step, monkeypatch) -> None:
    """The table decode gives what decoding element by element gives: the e4m3 value times its
    block's scale in fp32, rounded once to the dtype, for every byte and whatever the gather step."""
    monkeypatch.setattr(codec, "_GATHER_STEP", step)
    shape = (L, 2, H, 8, 32)
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(L, 2, H, generator=g) * 8
    scale[0, 0, 0] = 3e-39  # subnormal
    q = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    q.view(-1)[:256] = torch.arange(256).to(torch.uint8)
    raw = scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()
    payload = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    out = codec.decode(payload, Codec.FP8, dtype, shape, len(raw), zlib.crc32(raw))
    expected = (q.view(torch.float8_e4m3fn).float() * scale[..., None, None]).to(dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def test_fp8_refuses_non_finite() -> None:
    kv = kv_for(toks(1))
    kv[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        codec.encode(kv, Codec.FP8)


def test_decode_refuses_a_frame_larger_than_the_header_says() -> None:
    kv = kv_for(toks(1))
    raw = codec.raw_bounds(Codec.LOSSLESS, kv.dtype, tuple(kv.shape))[0]
    bigger = zstandard.ZstdCompressor().compress(bytes(raw * 64))
    with pytest.raises(ValueError, match="declares"):
        codec.decode(bigger, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), raw, 0)
    with pytest.raises(ValueError, match="does not fit"):
        codec.decode(bigger, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), raw * 64, 0)


def test_frame_checksum_is_verified_and_old_frames_fall_back_to_the_raw_crc() -> None:
    """Frames carry zstd's content checksum, which replaces the raw crc32 on decode: a frame whose
    checksum disagrees with its content is refused even when the header's raw crc matches that
    content; a frame without one (older files) is still held to the raw crc."""
    kv = torch.randn(2, 2, 1, 4, 8).half()
    enc = codec.encode(kv, Codec.LOSSLESS)
    assert zstandard.get_frame_parameters(enc.payload).has_checksum
    other = codec.split_planes(kv + 1)
    forged = zstandard.ZstdCompressor(write_checksum=True).compress(other)
    bad = bytearray(forged)
    bad[-1] ^= 0xFF  # the frame's checksum no longer matches its content
    with pytest.raises(ValueError, match="zstd"):
        codec.decode(bytes(bad), Codec.LOSSLESS, kv.dtype, tuple(kv.shape), len(other), zlib.crc32(other))
    legacy = zstandard.ZstdCompressor(write_checksum=False).compress(other)
    with pytest.raises(ValueError, match="raw checksum"):
        codec.decode(legacy, Codec.LOSSLESS, kv.dtype, tuple(kv.shape), enc.raw_len, enc.raw_crc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_key_means_are_the_engines_summaries_bit_for_bit_on_the_cpu(dtype) -> None:
    """A chunk file stores its summary as the difference from these means: for 16-bit KV on a CPU
    engine, at its runs of 16 tokens (64-token chunks, 4 summary blocks), it is zero, which keeps the
    summary out of the chunk files' bytes (fp32 KV, where torch sums in another order, and other
    devices leave a few bits in it)."""
    torch.manual_seed(0)
    pool = (torch.randn(3, 4, 2, 3, 64, 16) * torch.logspace(-3, 3, 16)).to(dtype)  # [slots, L, 2, H, C, D]
    slots = torch.tensor([2, 0])
    engine = kernels.reference.chunk_summaries(pool, slots, 4)
    for i, s in enumerate(slots.tolist()):
        means = torch.from_numpy(key_means(pool[s], 4))
        assert torch.equal(means.view(torch.int32), engine[i].view(torch.int32))
