"""What a new process imports before its first turn: start-up is part of what a user waits for."""

from __future__ import annotations

import subprocess
import sys

BUILD = """
import sys
import torch
from kvflash.models.loader import build_model
from kvflash.models.llama import LlamaForCausalLM
sys.path.insert(0, "tests")
from tiny import tiny_config
cfg = tiny_config()
with torch.device("meta"):
    shapes = {k: v.shape for k, v in LlamaForCausalLM(cfg).state_dict().items()}
model = build_model(cfg, {k: torch.zeros(s) for k, s in shapes.items()}, torch.float32, torch.device("cpu"))
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_building_a_model_imports_no_compiler() -> None:
    """nn.init and meta-device factories import torch._dynamo on first use; a model whose weights
    are assigned after construction needs neither."""
    out = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
