"""GGML dequantisation in torch against the `gguf` package's numpy code (the oracle), type by type,
and GGUF files of those types through the loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as oracle
from gguf_util import TinySpec, write_tiny_gguf

from kvflash import KVFlashError
from kvflash.models import dequant
from kvflash.models.dequant import TYPES, dequantize, random_blocks
from kvflash.models.gguf_loader import GGUFModel, load_gguf
from kvflash.models.loader import load_model

CPU = torch.device("cpu")
NAMES = [t.name for t in TYPES.values()]


def _kind(name: str) -> dequant.GGMLType:
    return TYPES[GGMLQuantizationType[name].value]


def _ours(blocks: np.ndarray, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    kind = _kind(name)
    raw = torch.from_numpy(blocks.reshape(-1))
    return dequantize(raw, kind, blocks.shape[0] * kind.block_size, CPU, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_random_blocks_dequantize_bit_equal_to_the_oracle(name) -> None:
    """fp32 results are bit-equal (same operations in the same order); bf16 is that rounded once."""
    blocks = random_blocks(_kind(name), 300, np.random.default_rng(1))
    want = torch.from_numpy(np.ascontiguousarray(oracle(blocks, GGMLQuantizationType[name]).reshape(-1)))
    got = _ours(blocks, name)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(_ours(blocks, name, torch.bfloat16), want.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q5_0"])
def test_slices_of_blocks_join_seamlessly(name, monkeypatch) -> None:
    """A tensor dequantised in several slices (the last one short) equals the one-slice result."""
    blocks = random_blocks(_kind(name), 37, np.random.default_rng(2))
    whole = _ours(blocks, name)
    monkeypatch.setattr(dequant, "SLICE_ELEMENTS", 5 * _kind(name).block_size)
    assert torch.equal(_ours(blocks, name), whole)


def test_a_partial_block_is_refused() -> None:
    with pytest.raises(KVFlashError, match="whole Q4_K blocks"):
        dequantize(torch.zeros(144, dtype=torch.uint8), _kind("Q4_K"), 100, CPU, torch.float32)


K_SPEC = TinySpec(hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512)
"""Rows of 256: whole blocks of every type, the k-quants' included."""


@pytest.mark.parametrize("storage", ["q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "bf16"])
def test_gguf_of_each_type_loads_the_oracles_weights(tmp_path, storage) -> None:
    path = tmp_path / f"{storage}.gguf"
    expected = write_tiny_gguf(path, K_SPEC, storage=storage)
    _, weights, _ = load_gguf(path)
    assert weights.keys() == expected.keys()
    for name, w in expected.items():
        assert torch.equal(weights[name], w), name


def test_an_unsupported_tensor_type_is_one_line_naming_it(tmp_path) -> None:
    path = tmp_path / "iq.gguf"
    write_tiny_gguf(path, K_SPEC, storage="q4_k", raw_type_of={"blk.0.ffn_up.weight": "IQ2_XXS"})
    with pytest.raises(KVFlashError) as err:
        load_gguf(path)
    message = str(err.value)
    assert "blk.0.ffn_up.weight" in message and "IQ2_XXS" in message and "\n" not in message


def test_loading_reports_progress_over_the_tensor_bytes(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, K_SPEC, storage="q6_k")
    seen: list[tuple[int, int]] = []
    load_model(path, device="cpu", on_progress=lambda done, total: seen.append((done, total)))
    model = GGUFModel(path)
    assert len(seen) == len(model.tensors) and {t for _, t in seen} == {model.nbytes}
    assert [d for d, _ in seen] == sorted({d for d, _ in seen}) and seen[-1][0] == model.nbytes
