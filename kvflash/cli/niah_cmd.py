"""`kvflash niah`: needle-in-a-haystack accuracy of one arm over lengths × depths × trials."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from kvflash import KVFlashError
from kvflash.cli.engine_options import ENGINE, EngineOptions, engine_command, load_model
from kvflash.cli.options import JsonOpt
from kvflash.eval.haystack import TEMPLATES
from kvflash.eval.niah import MODES, NiahConfig, run
from kvflash.eval.niah_report import table


def parse_lengths(value: str) -> tuple[int, ...]:
    """Comma list of token counts; `4K` means 4096. One given twice is one length (the grid would
    run its trials twice)."""
    out = []
    for part in value.split(","):
        p = part.strip().lower()
        try:
            out.append(int(p[:-1]) * 1024 if p.endswith("k") else int(p))
        except ValueError:
            raise KVFlashError(
                f"--lengths takes token counts such as 2048,4K, not {part.strip()!r}"
            ) from None
    return tuple(dict.fromkeys(out))


def parse_depths(value: str) -> tuple[float, ...]:
    """A bare integer n >= 2 is n evenly spaced depths from 0 to 1; otherwise a comma list in 0..1."""
    v = value.strip()
    if v.isdigit():
        n = int(v)
        if n < 2:
            raise KVFlashError("--depths takes a count of at least 2, or a comma list such as 0.5 or 0,0.5,1")
        return tuple(round(i / (n - 1), 4) for i in range(n))
    try:
        return tuple(dict.fromkeys(float(p) for p in v.split(",")))
    except ValueError:
        raise KVFlashError(
            f"--depths takes a count such as 11 or a list such as 0,0.5,1, not {value!r}"
        ) from None


@engine_command(
    defaults={"policy": "full"}, helps={"pool_tokens": "KV pool in tokens (not with policy full)."}
)
def niah(
    lengths: str = typer.Option(
        "2048,4096,8192", "--lengths", help="Document lengths in tokens (4K = 4096)."
    ),
    depths: str = typer.Option("11", "--depths", help="Count of depths over 0..1, or a comma list of them."),
    trials: int = typer.Option(4, "--trials", help="Trials (needles) per length and depth."),
    budget_frac: float = typer.Option(None, "--budget-frac", help="KV pool as a share of each length."),
    mode: str = typer.Option(
        "cold", "--mode", help=f"{', '.join(MODES)}: restore answers after restoring a disk snapshot."
    ),
    codec: str = typer.Option("lossless", "--codec", help="Snapshot codec in restore modes: lossless, fp8."),
    template: str = typer.Option("passcode", "--template", help=f"Needle: {', '.join(TEMPLATES)}."),
    haystack: Path = typer.Option(None, "--haystack", help="Filler text file (default: generated prose)."),
    needle: str = typer.Option(None, "--needle", help="Needle template with {value} (and optionally {key})."),
    question: str = typer.Option(None, "--question", help="Question template (may use {key})."),
    seed: int = typer.Option(0, "--seed", help="Run seed; each trial's needle derives from it."),
    max_tokens: int = typer.Option(32, "--max-tokens", "-n", help="Most tokens per answer."),
    pin_needle: bool = typer.Option(
        False, "--pin-needle", help="Pin the needle's characters (as --pin does)."
    ),
    out: Path = typer.Option(Path("niah-out"), "--out", help="Output directory (rerun it to resume)."),
    engine: EngineOptions = ENGINE,
    as_json: bool = JsonOpt,
) -> None:
    """Needle-in-a-haystack grid for one arm; writes results.jsonl, summary.json and heatmap.png to OUT."""
    pool_tokens = engine.pool(default=None)
    if pool_tokens == "auto":
        raise KVFlashError(
            "niah takes --pool-tokens as a number of tokens: an arm's pool is the same on every run"
        )
    cfg = NiahConfig(
        lengths=parse_lengths(lengths), depths=parse_depths(depths), trials=trials,
        pool_tokens=pool_tokens, budget_frac=budget_frac, policy=engine.policy, mode=mode,
        cache_positions=not engine.absolute_positions, cache_order=engine.cache_order,
        scout_reads=engine.scout_reads, codec=codec,
        template=template, haystack=str(haystack.resolve()) if haystack else None,
        needle=needle, question=question, seed=seed, max_tokens=max_tokens, pin_needle=pin_needle,
        out=str(out),
        model=str(engine.model) if engine.model else None, dtype=engine.dtype,
        kv_dtype=engine.kv_dtype or "auto", device=engine.device,
    )  # fmt: skip
    base = engine.config(pool_tokens)  # each trial's engine replaces the pool (NiahConfig.pool_for)
    lm = None
    if pool_tokens is not None:  # refused before the grid's first engine allocates the pool
        lm = load_model(engine, base, progress=False)
    summary = run(cfg, lm, None if as_json else Console(stderr=True, highlight=False), base)
    if as_json:
        print(json.dumps(summary))
    else:
        Console(highlight=False).print(table(summary))
