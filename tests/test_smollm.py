"""The real default model: answers, perplexity, and the generate command end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from kvflash.cli.generate_cmd import dense_config
from kvflash.config import ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, decode, eager_step
from kvflash.kvcache import ContiguousKV
from kvflash.models.loader import load_model

PROSE = (
    "The river ran slowly through the old town, past the mill and the church, and under the stone "
    "bridge where children liked to fish in the summer. In the evenings the light turned gold on the "
    "water, and the people who lived along the banks would sit outside their houses and talk about "
    "the day. Most of them had lived there all their lives, and they knew every bend of the river "
    "and every tree that grew beside it."
)


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return load_model(smollm_path, dtype="fp32", device="cpu")


def greedy(lm, prompt: str, max_tokens: int = 24) -> str:
    tok = lm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    kv = ContiguousKV(lm.config, len(ids) + max_tokens, lm.dtype, lm.device)
    logits = lm.model(torch.tensor(ids), torch.arange(len(ids)), kv)[0]
    gen = Generation(max_tokens, Sampler(Sampling(), lm.device), tok.eos_ids)
    return tok.decode(decode(eager_step(lm.model, kv), logits, len(ids), gen))


def test_capital_of_france(smollm) -> None:
    assert "Paris" in greedy(smollm, "What is the capital of France?")


def test_perplexity_on_prose_is_sane(smollm) -> None:
    ids = smollm.tokenizer.encode(PROSE)
    kv = ContiguousKV(smollm.config, len(ids), smollm.dtype, smollm.device)
    logits = smollm.model(torch.tensor(ids), torch.arange(len(ids)), kv, all_logits=True)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    ppl = math.exp(nll.item())
    assert 4.0 < ppl < 25.0, f"perplexity {ppl:.2f}"


def test_generate_engine_prefills_in_pieces_what_the_dense_cache_computes(smollm) -> None:
    """`kvflash generate`'s engine (`dense_config`), a chunk of 16 tokens per prefill piece, ends at
    the logits of the dense cache's one-shot forward."""
    ids = smollm.tokenizer.encode(PROSE)
    dense = ContiguousKV(smollm.config, len(ids), torch.float32, "cpu")
    one = smollm.model(torch.tensor(ids), torch.arange(len(ids)), dense)[0]
    cfg = dense_config(smollm, len(ids))
    cfg = replace(cfg, prefill_step_tokens=16, residency=ResidencyConfig(chunk_tokens=16, policy="full"))
    eng = Engine(smollm, cfg, warm=False)
    pieces = []
    logits = eng.prefill(eng.new_sequence(), ids, pieces.append)
    assert len(pieces) > 3 and set(pieces[:-1]) == {16}
    torch.testing.assert_close(logits, one, rtol=1e-4, atol=1e-4)


def kvflash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvflash.cli.app", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_command_json(smollm_path) -> None:
    r = kvflash(
        "generate",
        "What is the capital of France?",
        "--max-tokens",
        "12",
        "--json",
        "--model",
        str(smollm_path),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"]
    assert out["completion_tokens"] >= 1 and out["prompt_tokens"] > 5


def test_model_info_json(smollm_path) -> None:
    r = kvflash("model", "info", "--model", str(smollm_path), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "llama" and info["layers"] == 30 and info["kv_heads"] == 3
    assert info["kv_dtype"] == "bfloat16"  # auto: bf16 KV under the CPU's fp32 compute
    assert info["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert len(info["fingerprint"]) == 32


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--model", "/nonexistent.gguf"], "model not found"),
        (["generate", "hi", "--dtype", "fp12"], "unknown dtype"),
        (["model", "info", "--model", "{garbage}"], "model not found"),
    ],
)
def test_bad_input_is_one_line(args, message) -> None:
    r = kvflash(*args)
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_corrupt_model_file_is_one_line(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    r = kvflash("generate", "hi", "--model", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_flag_is_a_usage_error() -> None:
    r = kvflash("generate", "hi", "--max-tokens", "zero")
    assert r.returncode == 2 and "Traceback" not in r.stderr
