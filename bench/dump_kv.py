"""Dumps real model KV, chunk by chunk, for `bench/storage.py --kv-file`.

Loads a model (default: SmolLM2-135M-Instruct) in bf16, the KV dtype on the GPU, prefills seeded
English prose (`kvflash.eval.haystack.filler_sentences`) through the dense reference cache, and writes
each full chunk's post-RoPE KV `[L, 2, Hkv, C, D]` as tensor `chunk_00000`, `chunk_00001`, ... of a
safetensors file. The partial tail chunk is dropped: only full chunks are ever stored.

    python -m bench.dump_kv --tokens 4096 --out /tmp/smollm2_kv.safetensors
    python -m bench.storage --kv-file /tmp/smollm2_kv.safetensors --out docs/storage-smollm2.json
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.harness import out_dir
from kvflash.eval.haystack import filler_sentences
from kvflash.kvcache import ContiguousKV
from kvflash.models.loader import load_model


def prose_tokens(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """At least n_tokens ids of seeded filler prose (BOS first if the model wants one), cut to n_tokens."""
    rng = random.Random(seed)
    sentences = filler_sentences(rng)
    text = ""
    while True:
        text += " ".join(next(sentences) for _ in range(200)) + " "
        ids = tokenizer.encode(text)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens to prefill (default 4096)")
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--step", type=int, default=512, help="prefill tokens per forward (default 512)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--out", type=Path, required=True, help="safetensors file to write")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_model(args.model, dtype="bf16", device=args.device)
    if lm.tokenizer is None:
        raise SystemExit("the model has no tokenizer")
    ids = prose_tokens(lm.tokenizer, args.tokens, args.seed)
    cache = ContiguousKV(lm.config, len(ids), lm.dtype, lm.device)
    t = time.perf_counter()
    for start in range(0, len(ids), args.step):
        chunk = torch.tensor(ids[start : start + args.step], device=lm.device)
        lm.model(chunk, torch.arange(start, start + chunk.numel(), device=lm.device), cache)
    prefill_s = time.perf_counter() - t

    c = args.chunk_tokens
    n = cache.length // c
    tensors = {f"chunk_{i:05d}": cache.buf[:, :, :, i * c : (i + 1) * c].contiguous().cpu() for i in range(n)}
    out_dir(args.out.parent)
    save_file(
        tensors,
        str(args.out),
        metadata={
            "model": str(lm.path.name),
            "fingerprint": lm.fingerprint(c, lm.dtype),
            "tokens": str(cache.length),
            "chunk_tokens": str(c),
            "seed": str(args.seed),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "text": "kvflash.eval.haystack.filler_sentences",
        },
    )
    shape = list(tensors["chunk_00000"].shape)
    print(
        f"{args.out}: {n} chunks {shape} {lm.dtype} from {cache.length} tokens of prose "
        f"({lm.path.name}, prefill {prefill_s:.1f} s on {lm.device})"
    )


if __name__ == "__main__":
    main()
