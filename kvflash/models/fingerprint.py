"""The model fingerprint: KV made under one fingerprint is never restored under another."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from kvflash.config import ModelConfig
from kvflash.paths import kvflash_home, write_whole

_CHUNK = 1 << 22


def model_fingerprint(cfg: ModelConfig, weights_id: str, kv_dtype: torch.dtype, chunk_tokens: int) -> str:
    """Hash of architecture (RoPE parameters included), weights identity, KV dtype and chunk size."""
    payload = {
        "config": cfg.to_dict(),
        "weights": weights_id,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "chunk_tokens": chunk_tokens,
    }
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def weights_identity(files: list[Path]) -> str:
    """sha256 over the files' bytes, in order, hashed once per version of the files.

    A record in $KVFLASH_HOME/weights-ids, named after the files' paths, keeps the hash with each
    file's size, mtime, ctime and inode; while they all match, the hash is taken from it (an 8B
    GGUF takes seconds to hash). Any change to a file rehashes. A home that cannot be written only
    costs the reuse.
    """
    files = [Path(f).resolve() for f in files]
    stamp = [[str(f), *_stat(f)] for f in files]
    key = hashlib.sha256(json.dumps([s[0] for s in stamp]).encode()).hexdigest()[:32]
    record = kvflash_home() / "weights-ids" / f"{key}.json"
    try:
        saved = json.loads(record.read_text())
        if saved.get("files") == stamp and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = _hash_files(files)
    if [[str(f), *_stat(f)] for f in files] == stamp:  # unchanged while it was read
        _write_atomic(record, json.dumps({"files": stamp, "sha256": digest}))
    return digest


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while block := fh.read(_CHUNK):
                h.update(block)
    return h.hexdigest()


def _stat(f: Path) -> list[int]:
    st = f.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _write_atomic(path: Path, text: str) -> None:
    """`write_whole`, where a marker that cannot be written only costs the next start a re-hash."""
    try:
        write_whole(path, text)
    except OSError:
        pass
