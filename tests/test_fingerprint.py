"""The weights' identity in the fingerprint: the files' sha256, hashed once per version of them."""

from __future__ import annotations

import hashlib

import torch
from gguf_util import write_tiny_gguf

from kvflash.models import fingerprint
from kvflash.models.loader import load_model


def test_weights_are_hashed_once_and_a_changed_file_changes_the_fingerprint(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("KVFLASH_HOME", str(home))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, seed=0)
    first = load_model(path, device="cpu")
    assert first.weights_id == hashlib.sha256(path.read_bytes()).hexdigest()
    assert len(list((home / "weights-ids").glob("*.json"))) == 1  # the record the next start reads

    def no_rehash(files):
        raise AssertionError("rehashed unchanged weights")

    with monkeypatch.context() as m:
        m.setattr(fingerprint, "_hash_files", no_rehash)
        again = load_model(path, device="cpu")
        assert again.fingerprint(64, torch.bfloat16) == first.fingerprint(64, torch.bfloat16)

    write_tiny_gguf(path, seed=1)  # same shapes, so the same size: other bytes
    changed = load_model(path, device="cpu")
    assert changed.weights_id == hashlib.sha256(path.read_bytes()).hexdigest() != first.weights_id
    assert changed.fingerprint(64, torch.bfloat16) != first.fingerprint(64, torch.bfloat16)


def test_an_unwritable_home_only_costs_the_reuse(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.write_text("a file where the directory would go")
    monkeypatch.setenv("KVFLASH_HOME", str(home))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights")
    for _ in range(2):
        assert fingerprint.weights_identity([path]) == hashlib.sha256(b"weights").hexdigest()
    assert home.read_text() == "a file where the directory would go"
