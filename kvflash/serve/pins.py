"""Pins a user asks for: spans of a session's prompt whose chunks stay resident whatever the policy
selects (`PagedKV.pin_range`), so a fact known to matter is never evicted.

`system` pins the system message (the documents); `last-turn` the previous question and answer;
`[DOC:]START:END` characters START to END of a document (by its name as given or its 0-based index;
the first one if omitted). A pin that would leave the policy no room below the budget is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflash import KVFlashError
from kvflash.models.tokenizer import Tokenizer
from kvflash.serve.documents import Document, document_spans

if TYPE_CHECKING:
    from kvflash.serve.protocol import Pin as RequestPin


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
    return token_span(tok, content, text_start + pin.start, text_start + pin.end)


def token_span(tok: Tokenizer, content: str, start: int, end: int) -> tuple[int, int]:
    """Tokens [lo, hi) of `content` (as `Tokenizer.encode_plain` gives them) covering its characters
    [start, end), which the caller has checked lie within it."""
    offsets = tok.offsets_plain(content)
    lo = next(i for i, (_, e) in enumerate(offsets) if e > start)
    hi = max(i for i, (s, _) in enumerate(offsets) if s < end) + 1
    return lo, hi


def request_pins(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    spans: dict[int, tuple[int, int]],
    pins: Sequence[RequestPin],
) -> list[tuple[int, int]]:
    """The token ranges [lo, hi) of a chat request's `kvflash.pin` entries, given where each
    message's content lies in its ids (`encode_messages`' spans). KVFlashError naming the entry for
    a message or a character range that the request does not have."""
    out: list[tuple[int, int]] = []
    for k, pin in enumerate(pins):
        if pin == "system":
            out += [spans[i] for i, m in enumerate(messages) if m["role"] == "system"]
        elif pin == "last-turn":
            answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            if answers:  # the previous answer, and its question where one comes right before it
                a = answers[-1]
                q = a - 1 if a > 0 and messages[a - 1]["role"] == "user" else a
                out.append((spans[q][0], spans[a][1]))
        else:
            if pin.message >= len(messages):
                raise KVFlashError(f"kvflash.pin[{k}]: no message {pin.message} ({len(messages)} messages)")
            content = str(messages[pin.message]["content"])
            end = len(content) if pin.end is None else pin.end
            if not pin.start < end <= len(content):
                raise KVFlashError(
                    f"kvflash.pin[{k}]: characters {pin.start}:{end} are not within message "
                    f"{pin.message}, which has {len(content)}"
                )
            lo, hi = token_span(tok, content, pin.start, end)
            base = spans[pin.message][0]
            out.append((base + lo, base + hi))
    return [(lo, hi) for lo, hi in out if lo < hi]
