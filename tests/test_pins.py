"""Pins a user asks for: parsed with clear errors, mapped to the tokens of the characters they name,
and kept resident by a session whatever its pool."""

from __future__ import annotations

import pytest

from kvflash import KVFlashError
from kvflash.models.loader import load_model
from kvflash.serve.documents import Document, document_spans, system_message
from kvflash.serve.pins import Pin, char_tokens, parse_pin
from kvflash.serve.session import Session
from tests.test_session import FACT, Q1, document, engine


@pytest.fixture(scope="module")
def lm(smollm_path):
    return load_model(smollm_path, dtype="fp32", device="cpu")


def test_pin_specs_parse_or_name_the_accepted_forms() -> None:
    assert parse_pin("system") == Pin("system") and parse_pin("last-turn") == Pin("last-turn")
    assert parse_pin("10:20") == Pin("chars", "0", 10, 20)
    assert parse_pin("notes.txt:5:9") == Pin("chars", "notes.txt", 5, 9)
    assert parse_pin("c:/a.txt:5:9") == Pin("chars", "c:/a.txt", 5, 9)
    for bad in ("middle", "9:3", "4:4", "-1:5", "a:b", "x:1:y"):
        with pytest.raises(KVFlashError, match="--pin"):
            parse_pin(bad)


def test_document_spans_locate_each_text_in_the_system_message() -> None:
    docs = [Document("a.txt", "first text"), Document("b.txt", "second, longer text")]
    content = system_message(docs)["content"]
    assert [content[a:b] for a, b in document_spans(docs)] == [d.text for d in docs]


def test_a_character_pin_covers_exactly_the_tokens_of_its_text(lm) -> None:
    tok = lm.tokenizer
    docs = [Document("a.txt", "Nothing here. " * 20), document()]
    content = system_message(docs)["content"]
    at = docs[1].text.index(FACT)
    lo, hi = char_tokens(tok, docs, content, Pin("chars", "town.txt", at, at + len(FACT)))
    ids = tok.encode_plain(content)
    assert FACT in tok.decode(ids[lo:hi]) and FACT not in tok.decode(ids[lo + 1 : hi])
    assert FACT not in tok.decode(ids[lo : hi - 1])
    with pytest.raises(KVFlashError, match="no document"):
        char_tokens(tok, docs, content, Pin("chars", "other.txt", 0, 5))
    with pytest.raises(KVFlashError, match="characters"):
        char_tokens(tok, docs, content, Pin("chars", "1", 0, 10**6))


def test_a_pinned_fact_stays_resident_under_a_small_pool(lm) -> None:
    doc = document(n_sentences=90)
    at = doc.text.index(FACT)
    sess = Session(engine(lm, pool_tokens=512), [doc], pins=[parse_pin(f"{at}:{at + len(FACT)}")])
    try:
        _, stats = sess.ask(Q1, 4)
        kv = sess.kv
        pinned = [ch for ch in kv.seq.chunks if ch.pinned]
        assert stats.pinned_chunks == len(pinned) >= 1 and len(kv.seq.chunks) > kv.budget
        assert all(ch.gpu is not None for ch in pinned)  # resident at the answer
        c = kv.cfg.chunk_tokens
        text = lm.tokenizer.decode(
            [t for ch in pinned for t in kv.seq.tokens[ch.index * c : (ch.index + 1) * c]]
        )
        assert FACT in text
    finally:
        sess.close()


def test_last_turn_pins_the_previous_question_and_answer(lm) -> None:
    sess = Session(engine(lm, pool_tokens=1024), [document(n_sentences=90)], pins=[Pin("last-turn")])
    try:
        _, first = sess.ask(Q1, 4)
        assert first.pinned_chunks == 0  # no earlier turn yet
        _, second = sess.ask("And when?", 4)
        kv, c = sess.kv, sess.chunk_tokens
        pinned = [ch.index for ch in kv.seq.chunks if ch.pinned]
        q1 = lm.tokenizer.encode_plain(Q1)
        text = lm.tokenizer.decode([t for i in pinned for t in kv.seq.tokens[i * c : (i + 1) * c]])
        assert second.pinned_chunks == len(pinned) >= 1 and lm.tokenizer.decode(q1) in text
        _, third = sess.ask("And who?", 4)  # the second turn's span alone: the first's pins are gone
        pinned = [ch.index for ch in sess.kv.seq.chunks if ch.pinned]
        text = lm.tokenizer.decode([t for i in pinned for t in sess.kv.seq.tokens[i * c : (i + 1) * c]])
        assert third.pinned_chunks == len(pinned) and lm.tokenizer.decode(q1) not in text and "when" in text
        sess.reset()  # a new conversation over the documents: no turn before its first one
        _, fresh = sess.ask(Q1, 4)
        assert fresh.pinned_chunks == 0
    finally:
        sess.close()


def test_a_pin_that_breaks_the_floor_is_refused_with_the_flag_to_change(lm) -> None:
    sess = Session(engine(lm, pool_tokens=512), [document(n_sentences=90)], pins=[Pin("system")])
    try:
        with pytest.raises(KVFlashError, match="--pool-tokens"):
            sess.ask(Q1, 4)
    finally:
        sess.close()
