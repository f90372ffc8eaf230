"""`kvflash generate`: plain generation from a prompt, streamed to the terminal.

It runs the engine's prefill and decode loops over one sequence whose pool holds the prompt and the
answer (policy `full`, KV in the model's dtype): the dense computation, on the path every answer takes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

from kvflash import KVFlashError
from kvflash.cli.limits import check_pool_fits
from kvflash.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt
from kvflash.config import DTYPES, EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.engine.generate import Generation, Sampler, Sampling, decode
from kvflash.models.loader import LoadedModel, load_model
from kvflash.models.tokenizer import StreamDecoder


def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    model: Path = ModelOpt,
    chat: bool = typer.Option(True, "--chat/--raw", help="Wrap the prompt in the model's chat template."),
    temperature: float = typer.Option(0.0, min=0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", max=1.0, help="Nucleus mass kept, in (0, 1]."),
    seed: int = typer.Option(None, min=0, max=2**64 - 1, help="Seed for sampling (0 to 2**64 - 1)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Generate a reply to PROMPT, greedy by default."""
    if not top_p > 0:
        raise typer.BadParameter(
            f"{top_p} is not in (0, 1]: a nucleus keeps some mass", param_hint="'--top-p'"
        )
    lm = load_model(model, dtype=dtype, device=device)
    tok = lm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    ids = tok.encode(text)
    if not ids:
        raise KVFlashError("the prompt is empty")
    cfg = dense_config(lm, len(ids) + max_tokens)
    asked = f"{len(ids)} prompt tokens and --max-tokens {max_tokens}"
    check_pool_fits(lm, cfg.pool_tokens, cfg.residency.chunk_tokens, cfg.kv_dtype, asked)
    engine = Engine(lm, cfg, warm=False)
    kv = engine.new_sequence()
    console = Console(highlight=False)
    stream = StreamDecoder(tok)

    def show(t: int) -> None:
        if not as_json and (piece := stream.push(t)):
            console.out(piece, end="")

    t0 = time.perf_counter()
    logits = engine.prefill(kv, ids)
    sampler = Sampler(Sampling(temperature, top_p, seed), lm.device)
    gen = Generation(max_tokens, sampler, tok.eos_ids, show, t0=t0)
    out = decode(engine.decode_step(kv), logits, len(ids), gen)
    if as_json:
        print(
            json.dumps(
                {
                    "text": tok.decode(out),
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "ttft_s": gen.ttft_s if out else None,
                    "decode_tok_s": gen.decode_tok_s if len(out) > 1 else None,
                }
            )
        )
    else:
        console.out(stream.flush())


def dense_config(lm: LoadedModel, tokens: int) -> EngineConfig:
    """An engine whose one sequence holds `tokens` tokens, all resident, in the model's dtype: what a
    dense cache computes, with no host tier (nothing is evicted)."""
    kv_dtype = next(name for name, dt in DTYPES.items() if dt == lm.dtype)
    return EngineConfig(
        pool_tokens=tokens, host_bytes=0, residency=ResidencyConfig(policy="full"), kv_dtype=kv_dtype
    )
