"""The `kvflash` command: one typer app; each command group lives in its own module."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from kvflash import KVFlashError
from kvflash.cli import ask_cmd, bench_cmd, generate_cmd, model_cmd, niah_cmd, serve_cmd, snapshot_cmd

app = typer.Typer(
    name="kvflash",
    help="Long-document LLM sessions on GPUs smaller than the document's KV cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("generate")(generate_cmd.generate)
app.command("ask")(ask_cmd.ask)
app.command("chat")(ask_cmd.chat)
app.command("niah")(niah_cmd.niah)
app.command("serve")(serve_cmd.serve)
app.command("bench")(bench_cmd.bench)
app.add_typer(model_cmd.app, name="model")
app.add_typer(snapshot_cmd.app, name="snapshot")


def main() -> None:
    """Errors meant for the user print as one line on stderr with exit status 1, never a traceback."""
    try:
        app()
    except KVFlashError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
