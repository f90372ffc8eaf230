"""`kvflash bench`: time to first token over long documents on this machine, cold and restored."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvflash import KVFlashError
from kvflash.cli.engine_options import ENGINE, EngineOptions, engine_command, load_model
from kvflash.cli.niah_cmd import parse_lengths
from kvflash.cli.options import JsonOpt
from kvflash.config import resolve_kv_dtype
from kvflash.eval.bench import BenchConfig, plot, run, table


@engine_command()
def bench(
    lengths: str = typer.Option("4K,16K", "--lengths", help="Document lengths in tokens (4K = 4096)."),
    max_tokens: int = typer.Option(16, "--max-tokens", "-n", min=1, help="Most tokens per answer."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated documents and their passcodes."),
    out: Path = typer.Option(Path("bench-out"), "--out", help="Directory for bench.json and bench.png."),
    engine: EngineOptions = ENGINE,
    as_json: bool = JsonOpt,
) -> None:
    """Asks about a generated document twice per length, as two `kvflash ask` processes would (the
    second restores from a fresh snapshot store); prints both times to first token, writes
    bench.json and bench.png to OUT."""
    sizes = parse_lengths(lengths)
    if not sizes or min(sizes) < 1:
        raise KVFlashError("--lengths takes positive token counts such as 4K,16K")
    cfg = BenchConfig(lengths=sizes, engine=engine.config(), max_tokens=max_tokens, seed=seed)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KVFlashError(f"cannot write to --out {out}: {e.strerror}") from None
    lm = load_model(engine, cfg.engine, progress=False)
    err = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=err, transient=True,
    ) as bar:  # fmt: skip
        tasks: dict[str, int] = {}

        def on_prefill(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(f"prefill {label}", total=total)
            bar.update(tasks[label], completed=done, total=total)

        rows = run(lm, cfg, on_prefill)
    name = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else platform.machine()
    where = f"{lm.device.type} ({name})"
    result = {
        "device": where,
        "model": str(lm.path),
        "dtype": str(lm.dtype),
        "kv_dtype": str(resolve_kv_dtype(cfg.engine.kv_dtype, lm.dtype, lm.device)),
        "rows": rows,
    }
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "bench.png", where)
    if as_json:
        print(json.dumps(result))
        return
    Console().print(table(rows, where))
    err.print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
