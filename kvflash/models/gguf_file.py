"""The GGUF container read straight from a memory map: metadata, tensor infos and each tensor's bytes.

The `gguf` package's reader builds a numpy view per array element (one per vocab string), which
costs more than the rest of a small model's load; this reader walks the header with `struct` and
leaves string arrays undecoded until asked. Tensor bytes are never copied here: `raw` is a view of
the mapping that the dequantiser moves to the device.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_STRING, _ARRAY = 8, 9
_NUMBERS = {
    k: np.dtype(t).newbyteorder("<")
    for k, t in {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}.items()
}  # fmt: skip
"""GGUF metadata value type -> its little-endian numpy dtype (8 is a string, 9 an array)."""
_U32, _U64, _ITEMS = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<IQ")


class GGUFFormatError(ValueError):
    """Bytes that are not a GGUF file this reader understands (foreign, truncated, damaged)."""


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded on first access (a vocabulary is ~10^5 of them)."""

    def __init__(self, buf: mmap.mmap, offset: int, count: int):
        self._buf, self._offset, self._count = buf, offset, count
        self._items: list[str] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # type: ignore[override]
        return self._decoded()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def _decoded(self) -> list[str]:
        if self._items is None:
            buf, pos, out = self._buf, self._offset, []
            for _ in range(self._count):
                (n,) = _U64.unpack_from(buf, pos)
                out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            self._items = out
        return self._items


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """GGUF order: the innermost (contiguous) dimension first."""
    type_id: int
    offset: int
    """Absolute offset of the tensor's first byte in the file."""


class GGUFFile:
    """Metadata (`fields`: key -> Python scalar, str, numpy array or StringArray) and tensor infos of
    one GGUF file, over a private read-only mapping of it."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise GGUFFormatError("the file is empty")
            # ACCESS_COPY: a writable view for torch.frombuffer; nothing is ever written back.
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.size = size
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError) as e:
            raise GGUFFormatError(f"truncated or damaged header ({type(e).__name__})") from e

    def _parse(self) -> None:
        buf = self.buf
        if buf[:4] != MAGIC:
            raise GGUFFormatError("no GGUF magic at the start")
        (version,) = _U32.unpack_from(buf, 4)
        if version not in VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._unpack(_U32)
            if key in self.fields:  # llama.cpp refuses these too: which one holds is not defined
                raise GGUFFormatError(f"metadata key {key!r} twice")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack(_U32)
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
            shape = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            type_id, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            infos.append((name, tuple(int(d) for d in shape), type_id, offset))
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(align) is not int or align < 8 or align % 8:
            raise GGUFFormatError(f"alignment {align!r} (a multiple of 8)")
        if len({n for n, *_ in infos}) < len(infos):
            raise GGUFFormatError("a tensor name twice")
        if misaligned := next((n for n, _, _, o in infos if o % align), None):
            raise GGUFFormatError(f"tensor {misaligned!r} is not aligned to {align} bytes")
        data_start = -(-self._pos // align) * align
        self.tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def raw(self, info: TensorInfo, nbytes: int) -> torch.Tensor:
        """The tensor's bytes as a uint8 view of the mapping (no copy); the caller checks the extent."""
        return torch.frombuffer(self.buf, dtype=torch.uint8, count=nbytes, offset=info.offset)

    def _unpack(self, s: struct.Struct) -> tuple:
        out = s.unpack_from(self.buf, self._pos)
        self._pos += s.size
        return out

    def _string(self) -> str:
        (n,) = self._unpack(_U64)
        end = self._pos + n
        if end > self.size:
            raise GGUFFormatError("a string runs past the end of the file")
        s = self.buf[self._pos : end].decode("utf-8")
        self._pos = end
        return s

    def _numbers(self, dtype: np.dtype, count: int) -> np.ndarray:
        if self._pos + count * dtype.itemsize > self.size:
            raise GGUFFormatError("a value runs past the end of the file")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self._pos).copy()
        self._pos += count * dtype.itemsize
        return arr

    def _value(self, kind: int) -> Any:
        if kind in _NUMBERS:
            return self._numbers(_NUMBERS[kind], 1)[0].item()
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        item, count = self._unpack(_ITEMS)
        if item in _NUMBERS:
            return self._numbers(_NUMBERS[item], count)
        if item == _STRING:
            start, buf, pos = self._pos, self.buf, self._pos
            for _ in range(count):
                (n,) = _U64.unpack_from(buf, pos)
                pos += 8 + n
                if pos > self.size:
                    raise GGUFFormatError("a string array runs past the end of the file")
            self._pos = pos
            return StringArray(buf, start, count)
        raise GGUFFormatError(f"an array of value type {item}")  # arrays of arrays: none in GGUF
