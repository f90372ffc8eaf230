"""fp8 KV against bf16 KV on real model KV: the error of attention outputs, and of a run's logits.

Attention: seeded prose (bench/dump_kv.py's) is prefilled in bf16 through the dense reference cache,
keeping every layer's queries of the last --queries tokens. Each layer's attention of those queries
over the whole context (`kernels.prefill_attention`: the Triton kernel on CUDA, its twin elsewhere)
is computed over that bf16 KV and over the same KV written into an fp8 pool by
`kernels.write_tokens`, two ways: whole chunks at once, as a prefill writes them (each chunk's exact
scales), and a token at a time, as decode writes them (each chunk's scales from its first token
times FP8_HEADROOM, later tokens clamped). The relative error of an output row (a query token and
head) is max |fp8 - bf16| / max |bf16| over its head_dim values; the table gives the max and mean
over rows, and the share of K/V values clamped.

Scale rules: every chunk of that KV quantised per (layer, K/V, kv-head) block with its exact scale
(the block's largest magnitude / 448: a whole chunk written at once) and with the scale a chunk
begun by one token gets (that token's largest magnitude x headroom / 448, for several headrooms;
the engine's is FP8_HEADROOM): the error of each value relative to its block's largest magnitude
(max and mean over values, K and V apart) and the share of values clamped.

Decode terms: what the fp8 decode kernel's own arithmetic adds, apart from the KV's rounding. The
kernel's dots take e4m3 operands: the query as one e4m3 term or two (a value and its remainder,
scaled by row to fill e4m3's range), and the weights (probabilities x 256) likewise. Each layer's
attention of the last query token over the fp8 values of the whole-chunk pool, in float64 with
those roundings, against float64 without them (the same relative error per output row).

Logits: the engine with a pool that holds the whole prompt, bf16 KV and fp8 KV, prefills the prose
and decodes --decode teacher-forced tokens: the max relative error of the logits (over the largest
bf16 logit of the step) and how often both pick the same next token.

    python -m bench.kv_fp8 --out out/kv_fp8                                # CPU, 4K tokens
    python -m bench.kv_fp8 --device cuda --tokens 32768 --out out/kv_fp8   # the H200
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench.dump_kv import prose_tokens
from bench.harness import out_dir, run_meta, write_json
from kvflash import kernels
from kvflash.config import EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.kernels import reference
from kvflash.kernels._common import FP8_HEADROOM, FP8_MAX, fp8_scales
from kvflash.kvcache import ContiguousKV
from kvflash.models.loader import LoadedModel, load_model

FP8 = torch.float8_e4m3fn
STEP = 512
"""Prefill tokens per forward of the dense cache."""


class Recording(ContiguousKV):
    """The dense cache, keeping each layer's queries of the steps run while `record` is set."""

    record = False
    queries: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.record:
            self.queries[layer] = q.clone()
        return super().attend(layer, q, k, v)


def prefill_dense(lm: LoadedModel, ids: list[int], n_queries: int) -> Recording:
    cache = Recording(lm.config, len(ids), lm.dtype, lm.device)
    cache.queries = {}
    cut = len(ids) - n_queries
    with torch.inference_mode():
        for lo, hi in [(s, min(s + STEP, cut)) for s in range(0, cut, STEP)] + [(cut, len(ids))]:
            cache.record = lo == cut
            lm.model(
                torch.tensor(ids[lo:hi], device=lm.device), torch.arange(lo, hi, device=lm.device), cache
            )
    return cache


def fp8_pool(kv: torch.Tensor, c: int, by_token: bool) -> torch.Tensor:
    """One layer's KV [2, Hkv, N, D] written into an fp8 pool [N / C, 1, 2, Hkv, C + 1, D]: the whole
    context in one write (whole chunks), or offset by offset (each chunk begun by one token)."""
    _, h_kv, n, d = kv.shape
    pool = torch.zeros(n // c, 1, 2, h_kv, c + 1, d, dtype=FP8, device=kv.device)
    pos = torch.arange(n, device=kv.device)
    slot, off = (pos // c).int(), (pos % c).int()
    k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [N, Hkv, D]
    writes = [pos] if not by_token else [pos[j::c] for j in range(c)]
    for at in writes:
        kernels.write_tokens(pool, 0, slot[at], off[at], k[at].contiguous(), v[at].contiguous())
    return pool


def attention_errors(lm: LoadedModel, cache: Recording, c: int) -> list[dict]:
    """Per write mode: max and mean relative error of the output rows over all layers, the worst
    layer, and the share of values clamped."""
    n = cache.length
    q_start = n - cache.queries[0].shape[0]
    dev = lm.device
    slots = torch.arange(n // c, device=dev, dtype=torch.int32)
    scale = lm.config.head_dim**-0.5
    rows = []
    for mode, by_token in (("prefill (whole chunks)", False), ("decode (a token at a time)", True)):
        errs, clamped, total, worst = [], 0, 0, (0.0, -1)
        for layer in range(lm.config.n_layers):
            kv = cache.buf[layer, :, :, :n]  # [2, Hkv, N, D] bf16
            q = cache.queries[layer]
            bf16 = kv.reshape(2, kv.shape[1], n // c, c, -1).permute(2, 0, 1, 3, 4)[:, None].contiguous()
            fp8 = fp8_pool(kv, c, by_token)
            want = kernels.prefill_attention(q, bf16, 0, slots, slots, q_start, scale).float()
            got = kernels.prefill_attention(q, fp8, 0, slots, slots, q_start, scale).float()
            rel = (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)  # [T, Hq]
            errs.append(rel.flatten())
            if rel.max().item() > worst[0]:
                worst = (rel.max().item(), layer)
            limit = FP8_MAX * fp8_scales(fp8)[:, 0]  # [chunks, 2, Hkv]
            values = bf16[:, 0].float().abs()  # [chunks, 2, Hkv, C, D]
            clamped += int((values > limit[..., None, None] * (1 + 2**-4)).sum())
            total += values.numel()
        rel = torch.cat(errs)
        rows.append(
            {
                "part": "attention",
                "mode": mode,
                "max_rel": rel.max().item(),
                "mean_rel": rel.mean().item(),
                "worst_layer": worst[1],
                "clamped": clamped / total,
            }
        )
    return rows


def decode_terms(lm: LoadedModel, cache: Recording, c: int) -> list[dict]:
    """Max and mean relative error of the last query token's attention rows over all layers, for
    the query and the weights as one e4m3 term or two (`triton_decode._attend_fp8_block`)."""
    n, scale = cache.length, lm.config.head_dim**-0.5
    errs: dict[tuple[int, int], list[torch.Tensor]] = {(a, b): [] for a in (1, 2) for b in (1, 2)}
    for layer in range(lm.config.n_layers):
        vals = reference.kv_values(fp8_pool(cache.buf[layer, :, :, :n], c, False)[:, 0]).double()
        k, v = (vals[:, i].transpose(0, 1).flatten(1, 2) for i in (0, 1))  # [Hkv, N, D]
        q = cache.queries[layer][-1].double()  # [Hq, D]
        k, v = (x.repeat_interleave(q.shape[0] // k.shape[0], 0) for x in (k, v))
        want = torch.einsum("hn,hnd->hd", torch.softmax(torch.einsum("hd,hnd->hn", q, k) * scale, -1), v)
        up = FP8_MAX / q.abs().amax(-1, keepdim=True)
        for q_terms in (1, 2):
            qq = _e4m3_terms(q * up, q_terms) / up
            s = torch.einsum("hd,hnd->hn", qq, k) * scale
            p = torch.exp(s - s.amax(-1, keepdim=True))
            for w_terms in (1, 2):
                got = torch.einsum("hn,hnd->hd", _e4m3_terms(p * 256, w_terms), v) / (256 * p.sum(-1, True))
                errs[q_terms, w_terms].append(
                    (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)
                )
    rows = []
    for (q_terms, w_terms), e in errs.items():
        rel = torch.cat(e)
        mode = f"query {q_terms} e4m3 term{'s' * (q_terms > 1)}, weights {w_terms}"
        rows.append(
            {"part": "decode terms", "mode": mode, "max_rel": rel.max().item(), "mean_rel": rel.mean().item()}
        )
    return rows


def _e4m3_terms(x: torch.Tensor, terms: int) -> torch.Tensor:
    """x as the sum of `terms` e4m3 values: the nearest, then the nearest to what it left."""
    hi = x.to(FP8).double()
    return hi if terms == 1 else hi + (x - hi).to(FP8).double()


def scale_rules(cache: Recording, c: int, headrooms: tuple[float, ...]) -> list[dict]:
    """Value errors of the exact scales and of first-token scales with each headroom."""
    n = cache.length
    kv = cache.buf[:, :, :, :n].float()  # [L, 2, Hkv, N, D]
    blocks = kv.reshape(*kv.shape[:3], n // c, c, kv.shape[-1]).movedim(3, 0)  # [chunks, L, 2, Hkv, C, D]
    amax = blocks.abs().amax((-2, -1))
    first = blocks[..., :1, :].abs().amax((-2, -1))
    rules = [("exact (whole chunk)", reference.fp8_scale(amax, whole=True))]
    rules += [(f"first token x {h:g}", torch.where(first > 0, first * (h / FP8_MAX), 1.0)) for h in headrooms]
    rows = []
    for name, scale in rules:
        values = reference.quantize_fp8(blocks, scale[..., None, None]).float() * scale[..., None, None]
        err = (values - blocks).abs() / amax.clamp_min(1e-30)[..., None, None]
        clamped = blocks.abs() > (FP8_MAX * scale * (1 + 2**-4))[..., None, None]
        for i, part in enumerate("KV"):
            rows.append(
                {
                    "part": f"values ({part})",
                    "mode": name,
                    "max_rel": err[:, :, i].max().item(),
                    "mean_rel": err[:, :, i].mean().item(),
                    "clamped": clamped[:, :, i].float().mean().item(),
                }
            )
    return rows


def logit_errors(lm: LoadedModel, ids: list[int], forced: list[int]) -> dict:
    """bf16 KV and fp8 KV, a pool holding the whole prompt: prefill, then teacher-forced decode."""
    runs = []
    for kv_dtype in ("bf16", "fp8"):
        pool = len(ids) + len(forced) + 64
        engine = Engine(
            lm, EngineConfig(pool_tokens=pool, residency=ResidencyConfig(policy="full"), kv_dtype=kv_dtype)
        )
        kv = engine.new_sequence()
        with torch.inference_mode():
            out = [engine.prefill(kv, ids).float().cpu()]
            step = engine.decode_step(kv)
            for i, tok in enumerate(forced):
                out.append(step(tok, len(ids) + i).reshape(-1).float().cpu())
        kv.free()
        runs.append(torch.stack(out))
        del engine
    ref, got = runs
    rel = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
    return {
        "part": "logits",
        "mode": f"prefill + {len(forced)} decode steps",
        "max_rel": rel.max().item(),
        "mean_rel": rel.mean().item(),
        "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def table(rows: list[dict], tokens: int, queries: int) -> Table:
    t = Table(title=f"fp8 KV against bf16 KV, {tokens:,} tokens of prose ({queries} query tokens)")
    for col in ("part", "scales", "max rel. err", "mean rel. err", "clamped", "top-1 agree"):
        t.add_column(col, justify="left" if col in ("part", "scales") else "right")
    for r in rows:
        clamped = f"{r['clamped']:.2e}" if "clamped" in r else ""
        agree = f"{100 * r['top1_agree']:.1f} %" if "top1_agree" in r else ""
        t.add_row(r["part"], r["mode"], f"{r['max_rel']:.4f}", f"{r['mean_rel']:.5f}", clamped, agree)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=4096, help="prose tokens (a multiple of 64)")
    ap.add_argument("--queries", type=int, default=64, help="last tokens whose queries attend")
    ap.add_argument("--decode", type=int, default=32, help="teacher-forced decode steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("out/kv_fp8"))
    args = ap.parse_args()
    console = Console()
    c = ResidencyConfig().chunk_tokens
    if args.tokens % c or args.queries > args.tokens:
        raise SystemExit(f"--tokens must be a multiple of {c} and at least --queries")
    lm = load_model(args.model, dtype="bf16", device=args.device)
    ids = prose_tokens(lm.tokenizer, args.tokens + args.decode, args.seed)
    ids, forced = ids[: args.tokens], ids[args.tokens :]
    console.print(f"prefill {len(ids):,} tokens (dense, bf16) on {lm.device}")
    cache = prefill_dense(lm, ids, args.queries)
    with torch.inference_mode():
        rows = scale_rules(cache, c, (1, 4, 16, FP8_HEADROOM, 64)) + attention_errors(lm, cache, c)
        rows += decode_terms(lm, cache, c)
    del cache
    console.print("the engine: bf16 KV, then fp8 KV")
    rows.append(logit_errors(lm, ids, forced))
    console.print(table(rows, len(ids), args.queries))
    meta = run_meta(model=str(lm.path.name), args={k: str(v) for k, v in vars(args).items()})
    console.print(f"wrote {write_json(out_dir(args.out) / 'kv_fp8.json', {'meta': meta, 'rows': rows})}")


if __name__ == "__main__":
    main()
