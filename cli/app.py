"""The `kvflash` command: one typer app; each command group lives in its own module."""

from __future__ import annotations

import sqlite3
import sys
import warnings

import typer

from kvflash import KVFlashError
from kvflash.cli import ask_cmd, bench_cmd, generate_cmd, model_cmd, niah_cmd, serve_cmd, snapshot_cmd
from kvflash.cli.messages import error, show_warning

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
    """Errors meant for the user (bad flags, files the system refuses, a damaged index) print as one
    line on stderr, never a traceback: status 2 for usage errors, 1 otherwise. Warnings print as one
    line each."""
    warnings.showwarning = show_warning
    try:
        code = app(standalone_mode=False)
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        code = 130
    except typer.TyperException as e:  # click's usage errors, as typer vendors them
        if type(e).__name__ == "NoArgsIsHelpError":
            print(e.ctx.get_help())
            code = 0
        else:
            error(e.format_message())
            code = e.exit_code
    except KVFlashError as e:
        error(e)
        code = 1
    except OSError as e:
        error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else e)
        code = 1
    except sqlite3.DatabaseError as e:
        error(f"the snapshot index: {e}")
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
