"""What a new user meets: `make demo`'s answers on the CPU, and `--pool-tokens auto` without CUDA."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from kvflash.config import ModelConfig
from kvflash.engine.pool import chunk_bytes, slots_for

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_run", ROOT / "demo" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # two 8K-token document turns in two processes: minutes on a 2-core CPU
def test_the_demo_answers_hold_the_documents_facts(smollm_path, tmp_path) -> None:
    demo, out = _demo(), io.StringIO()
    first, second = demo.run(tmp_path / "store", [sys.executable, "-m", "kvflash.cli.app"], Console(file=out))
    assert "Mara Quill" in first["answer"] and "1843" in first["answer"], first["answer"]
    assert "seven" in second["answer"].lower(), second["answer"]
    assert first["source"] == "cold" and second["source"] in ("disk", "lazy")
    assert second["restored_tokens"] > 0
    console = Console(file=io.StringIO(), width=100)
    console.print(demo.table([first, second]))
    assert "Mara Quill" in console.file.getvalue()


def test_auto_pool_on_the_cpu_is_sized_from_host_memory() -> None:
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=576, intermediate_size=1536, n_layers=30,
                      n_heads=9, n_kv_heads=3, head_dim=64)  # fmt: skip
    per_chunk = chunk_bytes(cfg, 64, torch.float32)
    n = slots_for(cfg, "auto", 64, torch.float32, torch.device("cpu"), reserve_bytes=0)
    half_free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    assert n >= 1 and abs(n * per_chunk - half_free) < 0.25 * half_free + per_chunk
