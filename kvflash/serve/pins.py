"""Pins a user asks for: spans of a session's prompt whose chunks stay resident whatever the policy
selects (`PagedKV.pin_range`), so a fact known to matter is never evicted.

`system` pins the system message (the documents); `last-turn` the previous question and answer;
`[DOC:]START:END` characters START to END of a document (by its name as given or its 0-based index;
the first one if omitted). A pin that would leave the policy no room below the budget is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflash import KVFlashError
from kvflash.models.tokenizer import Tokenizer
from kvflash.serve.documents import Document, document_spans


@dataclass(frozen=True)
class Pin:
    kind: str
    """"system", "last-turn" or "chars"."""
    doc: str = "0"
    start: int = 0
    end: int = 0


def parse_pin(spec: str) -> Pin:
    """A --pin value; KVFlashError with the accepted forms otherwise."""
    if spec in ("system", "last-turn"):
        return Pin(spec)
    *doc, start, end = spec.rsplit(":", 2) if spec.count(":") >= 2 else ["0", *spec.split(":", 1)]
    try:
        lo, hi = int(start), int(end)
    except ValueError:
        lo = hi = -1
    if len(doc) != 1 or not 0 <= lo < hi:
        raise KVFlashError(
            f"--pin {spec!r}: expected system, last-turn or [DOC:]START:END (characters, START < END)"
        )
    return Pin("chars", doc[0], lo, hi)


def char_tokens(tok: Tokenizer, documents: list[Document], content: str, pin: Pin) -> tuple[int, int]:
    """Tokens [lo, hi) of the system content (as `Tokenizer.encode_plain` gives them) covering the
    pin's characters of its document."""
    names = [d.name for d in documents]
    index = int(pin.doc) if pin.doc.isdigit() else names.index(pin.doc) if pin.doc in names else -1
    if not 0 <= index < len(documents):
        raise KVFlashError(f"--pin: no document {pin.doc!r} (documents: {', '.join(names)})")
    text_start, text_end = document_spans(documents)[index]
    if text_start + pin.end > text_end:
        raise KVFlashError(
            f"--pin: {documents[index].name} has {text_end - text_start} characters, not {pin.end}"
        )
    a, b = text_start + pin.start, text_start + pin.end
    offsets = tok.offsets_plain(content)
    lo = next(i for i, (_, e) in enumerate(offsets) if e > a)
    hi = max(i for i, (s, _) in enumerate(offsets) if s < b) + 1
    return lo, hi
