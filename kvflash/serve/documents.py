"""Documents and the system message that carries them: the prompt's head, shared by local sessions
and by the thin client of a server (which must not import the engine to build it)."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's questions using the documents below."


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def _head(d: Document) -> str:
    return f'<document name="{d.name}">\n'


TAIL = "\n</document>"


def system_message(documents: list[Document], system: str = SYSTEM_PROMPT) -> dict:
    body = "\n\n".join(f"{_head(d)}{d.text}{TAIL}" for d in documents)
    return {"role": "system", "content": f"{system}\n\n{body}"}


def document_spans(documents: list[Document], system: str = SYSTEM_PROMPT) -> list[tuple[int, int]]:
    """Where each document's text lies in the content of `system_message`, in characters."""
    spans, at = [], len(system) + 2
    for d in documents:
        start = at + len(_head(d))
        spans.append((start, start + len(d.text)))
        at = start + len(d.text) + len(TAIL) + 2
    return spans
