"""Chat prompts as token ids, where message contents are always plain text.

The template is rendered with a placeholder per message content; the template's own text is encoded
with special tokens parsed, each content with them kept as text. So a document that contains
`<|im_end|>` cannot end a turn, and the engine knows every turn boundary by token position.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kvflash import KVFlashError
from kvflash.models.tokenizer import Tokenizer


def encode_messages(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    known: Mapping[int, Sequence[int]] | None = None,
    spans: dict[int, tuple[int, int]] | None = None,
) -> list[int]:
    """Ids of the whole rendered conversation. `known` maps a message's index to the ids of its
    content, already encoded (each content is encoded on its own, so they are the same ids); `spans`,
    where given, receives each message's content as ids [start, end) of the result."""
    tag = uuid.uuid4().hex
    rendered = _render(tok, messages, add_generation_prompt, tag)
    return _encode_rendered(tok, rendered, messages, tag, bos=True, known=known, spans=spans)


def content_start(tok: Tokenizer, messages: list[dict[str, Any]]) -> int:
    """Where the first message's content begins in the ids of `encode_messages`."""
    tag = uuid.uuid4().hex
    head = _render(tok, messages[:1], False, tag).split(f"\x00{tag}:0\x00")[0]
    return len(_encode_rendered(tok, head, [], tag, bos=True))


def encode_continuation(
    tok: Tokenizer,
    before: list[dict[str, Any]],
    new: list[dict[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Ids that follow the ids of `before` up to its last message's content, adding `new`.

    `before` ends with the model's answer, whose ids the model produced itself (its stop token not
    included): the result starts with the template text that closes that answer, then the rendered
    difference. Nothing already in the sequence is re-tokenised.
    """
    tag = uuid.uuid4().hex
    full = _render(tok, before + new, add_generation_prompt, tag)
    head = _render(tok, before, False, tag)
    if not full.startswith(head):
        raise KVFlashError("the chat template does not render conversations append-only")
    last = f"\x00{tag}:{len(before) - 1}\x00"
    closing = head[head.rindex(last) + len(last) :]
    text = closing + full[len(head) :]
    return _encode_rendered(tok, text, before + new, tag, bos=False)


def _render(tok: Tokenizer, messages: list[dict[str, Any]], add_gen: bool, tag: str) -> str:
    marked = [{**m, "content": f"\x00{tag}:{i}\x00"} for i, m in enumerate(messages)]
    return tok.apply_chat_template(marked, add_generation_prompt=add_gen)


def _encode_rendered(
    tok: Tokenizer,
    rendered: str,
    messages: list[dict[str, Any]],
    tag: str,
    bos: bool,
    known: Mapping[int, Sequence[int]] | None = None,
    spans: dict[int, tuple[int, int]] | None = None,
) -> list[int]:
    parts = _split_marks(rendered, tag)
    ids: list[int] = []
    for j, part in enumerate(parts):
        if j % 2:
            i, start = int(part), len(ids)
            ids += known[i] if known and i in known else tok.encode_plain(str(messages[i]["content"]))
            if spans is not None:
                spans[i] = (start, len(ids))
        elif part:
            ids += (
                tok.encode(part) if (bos and not ids) else tok.hf.encode(part, add_special_tokens=False).ids
            )
    return ids


def _split_marks(rendered: str, tag: str) -> list[str]:
    """The rendered template split at its content marks (`\\x00tag:i\\x00`): [text, i, text, i, ...,
    text]. Plain string splits: a regular expression of a new tag each call is compiled each call."""
    pieces = rendered.split(f"\x00{tag}:")
    parts = [pieces[0]]
    for piece in pieces[1:]:
        index, _, text = piece.partition("\x00")
        parts += [index, text]
    return parts
