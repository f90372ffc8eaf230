"""The `kvflash` command: one typer app; each command lives in its own module, imported only when
that command runs (or `--help` lists them all), so a thin command such as `ask --server` never pays
for torch."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, MutableMapping

import click
import typer
from rich.console import Console
from typer.core import TyperGroup

from kvflash import KVFlashError

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


def _load(name: str) -> click.Command:
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


class _LazyCommands(MutableMapping[str, click.Command]):
    """The group's commands, each built from its module on first lookup."""

    def __init__(self) -> None:
        self._built: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = _load(name)
        return self._built[name]

    def __setitem__(self, name: str, cmd: click.Command) -> None:
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
