"""The server's cache of long contents' ids: the ids a fresh encoding gives, bounded, least recent out."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvflash.models.loader import load_model
from kvflash.serve.content_ids import MIN_CHARS, ContentIds
from kvflash.serve.prompt import encode_messages


@pytest.fixture(scope="module")
def tok(smollm_path):
    return load_model(smollm_path, device="cpu").tokenizer


def _doc(seed: int) -> str:
    return " ".join(f"Line {seed}-{i}: the harbour keeps its <|im_end|> lamps lit." for i in range(120))


def test_cached_ids_render_the_prompt_a_fresh_encoding_renders(tok) -> None:
    cache = ContentIds(tok)
    messages = [{"role": "system", "content": _doc(0)}, {"role": "user", "content": "Who keeps the lamps?"}]
    assert len(messages[0]["content"]) >= MIN_CHARS
    first = cache.known(messages)
    again = cache.known(messages)
    assert list(first) == [0] and again[0] is first[0]  # the second turn did not encode it again
    assert encode_messages(tok, messages, known=again) == encode_messages(tok, messages)


def test_the_cache_holds_at_most_max_ids_dropping_the_least_recent(tok) -> None:
    one = len(tok.encode_plain(_doc(1)))
    cache = ContentIds(tok, max_ids=2 * one + 10)
    keep, drop, new = ({"role": "user", "content": _doc(s)} for s in (1, 2, 3))
    first_keep = cache.known([keep])[0]
    first_drop = cache.known([drop])[0]
    cache.known([keep])  # used again: the most recent
    cache.known([new])
    assert cache.known([keep])[0] is first_keep
    assert cache.known([drop])[0] is not first_drop  # encoded again


def test_a_content_asked_for_by_many_threads_at_once_is_encoded_once(tok, monkeypatch) -> None:
    """Conversations starting over one document together: the first thread encodes it, the others
    wait for its ids rather than encoding the same document beside it."""
    cache = ContentIds(tok)
    encoded, start = [], threading.Barrier(8)
    plain = tok.encode_plain

    def counted(text: str) -> list[int]:
        encoded.append(len(text))
        return plain(text)

    monkeypatch.setattr(tok, "encode_plain", counted)
    message = {"role": "system", "content": _doc(4) * 8}

    def ask(_) -> object:
        start.wait()
        return cache.known([message])[0]

    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(ask, range(8)))
    assert len(encoded) == 1 and all(i is ids[0] for i in ids)
    assert list(ids[0]) == plain(message["content"])
