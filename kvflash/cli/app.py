"""The `kvflash` command: one typer app; each command lives in its own module, imported only when
that command runs (or `--help` lists them all), so a thin command such as `ask --server` never pays
for torch."""

from __future__ import annotations

import importlib
import sqlite3
import sys
import warnings
from collections.abc import Iterator, MutableMapping

import typer
from typer.core import TyperCommand, TyperGroup

from kvflash import KVFlashError
from kvflash.cli.messages import error, show_warning

COMMANDS = {
    "generate": "kvflash.cli.generate_cmd:generate",
    "ask": "kvflash.cli.ask_cmd:ask",
    "chat": "kvflash.cli.ask_cmd:chat",
    "niah": "kvflash.cli.niah_cmd:niah",
    "serve": "kvflash.cli.serve_cmd:serve",
    "bench": "kvflash.cli.bench_cmd:bench",
    "model": "kvflash.cli.model_cmd:app",
    "snapshot": "kvflash.cli.snapshot_cmd:app",
}
"""Command name -> "module:attribute", a command function or a typer app of subcommands."""

Command = TyperCommand | TyperGroup
"""What typer builds from a command function or an app: a command of the click that typer vendors,
so the click package need not be imported."""


def _load(name: str) -> Command:
    module, attr = COMMANDS[name].split(":")
    obj = getattr(importlib.import_module(module), attr)
    if isinstance(obj, typer.Typer):
        cmd = typer.main.get_group(obj)
    else:
        single = typer.Typer()
        single.command(name)(obj)
        cmd = typer.main.get_command(single)
    cmd.name = name
    return cmd


class _LazyCommands(MutableMapping[str, Command]):
    """The group's commands, each built from its module on first lookup."""

    def __init__(self) -> None:
        self._built: dict[str, Command] = {}

    def __getitem__(self, name: str) -> Command:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = _load(name)
        return self._built[name]

    def __setitem__(self, name: str, cmd: Command) -> None:
        self._built[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMANDS, *self._built]))

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._built))


class _LazyGroup(TyperGroup):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.commands = _LazyCommands()


app = typer.Typer(
    name="kvflash",
    cls=_LazyGroup,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Long-document LLM sessions on GPUs smaller than the document's KV cache."""


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
