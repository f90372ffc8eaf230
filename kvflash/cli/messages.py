"""One-line messages on stderr. What they carry (file names, labels, session names, error text) is
printed literally: user text is never rich markup. rich is imported by the first message, so a
command that prints none (`ask --server` answering) never loads it."""

from __future__ import annotations


def error(message: object) -> None:
    _line("error:", "bold red", message)


def warn(message: object) -> None:
    _line("warning:", "yellow", message)


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """`warnings.showwarning` for the CLI: the message alone, on one line."""
    warn(message)


def _line(tag: str, style: str, message: object) -> None:
    from rich.console import Console
    from rich.text import Text

    text = " ".join(str(message).split("\n"))
    Console(stderr=True, highlight=False).print(Text.assemble((tag, style), " ", text), soft_wrap=True)
