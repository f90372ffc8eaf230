"""Long-document sessions: documents plus a conversation, restored from disk from turn to turn.

Each turn's prompt is the chat template over a system message carrying the documents, the history
and the question. The conversation is kept as the token ids the engine produced, so the next turn
appends to them instead of re-tokenising answers. After each turn the sealed prefix is snapshotted
(the grown prefix, so the next turn chains on it). A turn first reuses what is live in this process,
else the longest stored prefix (eagerly, or lazily when the KV is larger than the budget).
"""

from __future__ import annotations

import hashlib
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from kvflash.engine.engine import Engine
from kvflash.engine.generate import Sampling
from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.pool import summary_shape
from kvflash.serve.documents import Document, system_message
from kvflash.serve.pins import Pin, char_tokens
from kvflash.serve.prefix_cache import PrefixCache
from kvflash.serve.prompt import content_start, encode_continuation, encode_messages
from kvflash.serve.snapshots import KVSnapshots, StoredSummaries
from kvflash.serve.turn import TurnStats, answer
from kvflash.storage import ChunkError, SnapshotInfo, SnapshotStore, StoreError

CHARS_PER_TOKEN = 4
"""About the most characters a token of prose covers: a document's length over it underestimates its
tokens, so the host memory pinned ahead of its prefill is not more than the prefill uses."""


class Session:
    """One conversation over fixed documents; `name` makes it resumable from another process. One
    class for a conversation's whole life (resume, prompt, turn, save), which shares its messages,
    ids and live sequence throughout."""

    def __init__(
        self,
        engine: Engine,
        documents: list[Document],
        store: SnapshotStore | None = None,
        name: str | None = None,
        budget_tokens: int | None = None,
        lazy: bool | None = None,
        pins: Sequence[Pin] = (),
        prefetch: bool = True,
    ):
        """`prefetch`: after each answer, read a lazy restore's remaining chunks into the host tier
        for the next question (`KVSnapshots.start_prefetch`); without a next question in this
        process it would only compete with the save."""
        self.engine, self.documents, self.name, self.pins = engine, documents, name, tuple(pins)
        lm = engine.lm
        self.tok = lm.tokenizer
        self.chunk_tokens = engine.cfg.residency.chunk_tokens
        self.snapshots = (
            KVSnapshots(store, engine.fingerprint, prefetch, other_kv=engine.other_kv_fingerprints())
            if store
            else None
        )
        self.messages: list[dict] = [system_message(documents)]
        self.docs_hash = hashlib.sha256(self.messages[0]["content"].encode()).hexdigest()[:16]
        self.ids: list[int] = []
        self.cache = PrefixCache(engine, self.snapshots, budget_tokens, lazy)
        self._snapshot_id: str | None = None
        self._resume_tail: list[int] = []
        self._doc_span: list[int] | None = None
        """Where the documents' ids lie in the prompt: saved so a later process can take them from
        the snapshot's chunks instead of tokenising the documents again."""
        self._ahead: StoredSummaries | None = None
        """Summaries read while building this turn's prompt, for its restore."""
        self._known: StoredSummaries | None = None
        """The same, kept for the turn's snapshot, whose summaries file then need not read them."""
        self._last_turn: tuple[int, int] | None = None
        """Where the previous question and answer lie in the prompt (`last-turn` pins)."""
        if name and self.snapshots:
            self._resume()
        if self.snapshots:
            self._warn_other_kv()
        self._docs_ahead: Future[list[int] | None] | None = None
        """The documents' stored ids (and with them `_ahead`), read on a thread from construction to
        the first question: a caller that warms the engine after building the session overlaps
        the read with the warm-up (`kvflash ask` does)."""
        if self.snapshots and len(self.messages) == 1:
            self._docs_ahead = ahead = Future()
            threading.Thread(
                target=self._read_docs_ahead, args=(ahead,), daemon=True, name="kvflash-docs-ahead"
            ).start()

    def _read_docs_ahead(self, ahead: Future) -> None:
        """The future comes as an argument: the first question takes `_docs_ahead` (and sets it to
        None) whenever it comes, possibly before this thread first runs."""
        try:
            ahead.set_result(self._stored_document_ids())
        except BaseException as e:  # raised again where the result is taken
            ahead.set_exception(e)

    @property
    def kv(self) -> PagedKV | None:
        """The live sequence of this conversation, if any."""
        return self.cache.latest

    @property
    def label(self) -> str:
        return f"session:{self.name}" if self.name else f"ask:{self.docs_hash}"

    def _resume(self) -> None:
        """Takes the conversation of the newest snapshot of this named session that this engine can
        use (`KVSnapshots.usable`: its token ids are this model's), if its documents match."""
        ours = self._own_snapshots()
        if not ours:
            return
        latest = max(ours, key=lambda s: s.created)
        meta = latest.meta
        if meta.get("docs") != self.docs_hash:
            warnings.warn(
                f"session {self.name!r} was about other documents; starting a new conversation", stacklevel=2
            )
            return
        self.messages = [self.messages[0], *meta["messages"]]
        self._snapshot_id = latest.id
        self._resume_tail = meta.get("tail", [])
        self._doc_span = meta.get("doc_span")

    def reset(self) -> None:
        """Forgets the conversation (the documents stay): what it resumed from, and its last turn,
        which `last-turn` pins would otherwise name in the next one."""
        self.close()
        self.messages, self.ids = [system_message(self.documents)], []
        self._ahead = self._docs_ahead = None
        self._snapshot_id, self._resume_tail, self._last_turn = None, [], None

    def close(self) -> None:
        self.cache.close()

    def _prompt_ids(self, question: str) -> list[int]:
        user = {"role": "user", "content": question}
        if len(self.messages) == 1:
            ahead, self._docs_ahead = self._docs_ahead, None
            docs = ahead.result() if ahead is not None else self._stored_document_ids()
            if docs is None:  # a cold prefill follows: its host memory is pinned while tokenising
                self.engine.expect(len(self.messages[0]["content"]) // CHARS_PER_TOKEN)
                docs = self.tok.encode_plain(self.messages[0]["content"])
            start = content_start(self.tok, self.messages)
            self._doc_span = [start, start + len(docs)]
            return encode_messages(self.tok, self.messages + [user], known={0: docs})
        if not self.ids:
            self.ids = self._resumed_ids()
        return self.ids + encode_continuation(self.tok, self.messages, [user])

    def _stored_ids(self, snapshot_id: str) -> list[int]:
        """A snapshot's token ids, read with its summaries (the restore that follows reuses them)."""
        snap = self.snapshots.store.get_snapshot(snapshot_id)
        shape = summary_shape(self.engine.lm.config, self.engine.cfg.residency.summary_blocks)
        self._ahead = self.snapshots.read_summaries(snap.fingerprint, list(snap.chunk_hashes), shape)
        return [t for ts in self._ahead.tokens for t in ts]

    def _stored_document_ids(self) -> list[int] | None:
        """The documents' ids, from the chunks of the newest snapshot over them, if one holds them
        all: tokenising a long document again costs a visible share of a turn (docs/BENCHMARKS.md:
        Sessions)."""
        if not self.snapshots:
            return None
        ours = [s for s in self._own_snapshots() if s.meta.get("docs") == self.docs_hash]
        if not ours:
            return None
        latest = max(ours, key=lambda s: s.created)
        span, tail = latest.meta.get("doc_span"), latest.meta.get("tail")
        if not (_ints(span) and len(span) == 2 and _ints(tail)):
            return None
        if not 0 <= span[0] <= span[1] <= latest.n_chunks * self.chunk_tokens + len(tail):
            return None
        try:
            return (self._stored_ids(latest.id) + tail)[span[0] : span[1]]
        except StoreError:  # the restore meets the same damage, warns and goes cold
            return None

    def _own_snapshots(self) -> list[SnapshotInfo]:
        """This conversation's snapshots of this model: with KV this engine restores (`usable`), or
        with KV of another dtype, whose token ids are this model's (the conversation resumes, its
        KV is computed again)."""
        snaps = self.snapshots.store.list_snapshots()
        ours = self.snapshots.usable, self.snapshots.other_kv_dtype
        return [s for s in snaps if s.label == self.label and any(f(s.fingerprint) for f in ours)]

    def _warn_other_kv(self) -> None:
        """Says so when this conversation's KV is stored only in another dtype: the turn prefills
        cold, where a restore was expected."""
        ours = self._own_snapshots()
        if ours and not any(self.snapshots.usable(s.fingerprint) for s in ours):
            stored = self.snapshots.other_kv_dtype(max(ours, key=lambda s: s.created).fingerprint)
            warnings.warn(
                f"the stored KV of this conversation is {stored}; this engine keeps "
                f"{self.engine.kv_dtype_name} KV (--kv-dtype), so it computes the KV again",
                stacklevel=3,
            )

    def _resumed_ids(self) -> list[int]:
        """The stored chunks' tokens plus the tail; if the chunks are unreadable, the re-rendered text."""
        try:
            return self._stored_ids(self._snapshot_id) + list(self._resume_tail)
        except ChunkError as e:
            warnings.warn(f"session snapshot unusable ({e}); re-reading the conversation", stacklevel=3)
            *history, last = self.messages
            return encode_messages(self.tok, history, True) + self.tok.encode_plain(last["content"])

    def ask(
        self,
        question: str,
        max_tokens: int = 256,
        sampling: Sampling = Sampling(),
        on_text: Callable[[int], None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
        on_restore: Callable[[int, int], None] | None = None,
    ) -> tuple[str, TurnStats]:
        """One turn: restore, prefill the rest, generate. on_text gets each token id as it comes;
        on_restore and on_prefill (done, total) report progress."""
        stats = TurnStats()
        t0 = time.perf_counter()
        ids = self._prompt_ids(question)
        ahead, self._ahead = self._ahead, None
        self._known = ahead
        turn_start = len(self.ids) or (self._doc_span or [0, 0])[1]
        taken = self.cache.take(ids, on_restore, ahead)
        stats.took(taken)
        kv = taken.kv
        try:
            stats.pinned_chunks = self._pin(kv)
        except BaseException:
            self.cache.drop(kv)
            raise
        out: list[int] = []

        def on_token(tok: int) -> None:
            out.append(tok)
            if on_text:
                on_text(tok)

        try:
            try:
                self._answer(kv, ids, max_tokens, sampling, stats, t0, on_token, on_prefill)
            except ChunkError as e:  # a lazily restored chunk, damaged when read: go on cold
                warnings.warn(f"snapshot unusable ({e}); prefilling cold", stacklevel=2)
                dropped, kv = kv, None
                self.cache.drop(dropped)
                taken = self.cache.take(ids + out, reuse=False)
                stats.took(taken)
                kv = taken.kv
                self._answer(kv, ids + out, max_tokens - len(out), sampling, stats, t0, on_token, on_prefill)
                stats.generated_tokens = len(out)
        except BaseException:
            if kv is not None:  # dropped once already where the cold take itself failed
                self.cache.drop(kv)
            raise
        self.cache.keep(kv)
        text = self.tok.decode(out)
        self.ids = ids + out
        self._last_turn = (turn_start, len(self.ids))
        self.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
        if self.snapshots:
            self.snapshots.start_prefetch(kv)
            stats.snapshot_id = self.save()
        return text, stats

    def _pin(self, kv: PagedKV) -> int:
        """Pins this session's spans in kv, in place of what an earlier turn pinned (a continued
        sequence keeps its pins: `last-turn` would pin every turn so far); the count of its pinned
        chunks. KVFlashError for a pin that would break the floor or names no document."""
        kv.unpin_all()
        for pin in self.pins:
            if pin.kind == "system":
                span = (0, self._doc_span[1]) if self._doc_span else None
            elif pin.kind == "last-turn":
                span = self._last_turn  # none before the first answer
            else:
                content = self.messages[0]["content"]
                lo, hi = char_tokens(self.tok, self.documents, content, pin)
                span = (self._doc_span[0] + lo, self._doc_span[0] + hi) if self._doc_span else None
            if span is not None:
                kv.pin_range(*span)
        return kv.n_pinned

    def _answer(
        self,
        kv: PagedKV,
        ids: list[int],
        max_tokens: int,
        sampling: Sampling,
        stats: TurnStats,
        t0: float,
        on_token: Callable[[int], None],
        on_prefill: Callable[[int, int], None] | None,
    ) -> None:
        rest, eos = ids[len(kv.seq) :], self.tok.eos_ids
        answer(self.engine, kv, rest, max_tokens, sampling, eos, stats, t0, on_token, on_prefill)

    def save(self) -> str | None:
        """Snapshots the sealed prefix under this session's label, replacing the older snapshots it
        supersedes (`KVSnapshots.replace`: their hits carry over, so `snapshot list` counts the
        session's restores). A store error warns: the answer is not lost for it."""
        c = self.chunk_tokens
        n = self.kv.seq.n_sealed
        meta = {
            "docs": self.docs_hash,
            "doc_span": self._doc_span,
            "messages": self.messages[1:],
            "tail": self.ids[n * c :],
        }
        known, self._known = self._known, None
        try:
            sid = self.snapshots.save(self.kv, self.label, meta, known)
        except Exception as e:  # a full disk or a store error must not lose the answer
            warnings.warn(f"could not save the session snapshot: {e}", stacklevel=2)
            return None
        self._snapshot_id = sid
        return sid


def _ints(x: object) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) for i in x)
