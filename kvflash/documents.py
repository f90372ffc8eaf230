"""Documents and the system message that carries them: the prompt's head, shared by local sessions
and by the thin client of a server (which must not import the engine to build it)."""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_PROMPT = "You are a helpful assistant. Answer the user's questions using the documents below."


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def system_message(documents: list[Document], system: str = SYSTEM_PROMPT) -> dict:
    body = "\n\n".join(f'<document name="{d.name}">\n{d.text}\n</document>' for d in documents)
    return {"role": "system", "content": f"{system}\n\n{body}"}
