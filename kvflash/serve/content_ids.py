"""Ids of long message contents a server saw recently, by content hash.

An OpenAI client resends the whole conversation every turn, documents included: tokenising a long
document again would cost more than the turn's own prefill. `encode_messages` encodes each content
on its own, so the cached ids are exactly the ids the content encodes to. They are kept as 32-bit
arrays: `max_ids` of them take 4 bytes each, where a list of Python ints takes about 36. A content
being encoded is encoded once: many conversations starting over one document at once wait for the
first one's encoding instead of each encoding it beside the others.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import Any

from kvflash.models.tokenizer import Tokenizer

MIN_CHARS = 4096
"""Contents shorter than this are encoded again: hashing and keeping them would save nothing."""


class ContentIds:
    def __init__(self, tok: Tokenizer, max_ids: int = 1 << 22):
        self.tok, self.max_ids = tok, max_ids
        self._ids: OrderedDict[bytes, array] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # prompts are rendered on several threads at once
        self._encoding: dict[bytes, threading.Event] = {}
        """Contents being encoded now, set once their ids are in `_ids` (or their encoding failed)."""

    def known(self, messages: list[dict[str, Any]]) -> dict[int, array]:
        """`encode_messages`'s `known` for these messages: each long content's ids, encoded now
        where not seen before (least recently used ones go past `max_ids` held)."""
        out = {}
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, str) and len(content) >= MIN_CHARS:
                out[i] = self._get(content)
        return out

    def _get(self, content: str) -> array:
        """The content's ids: cached, or encoded by this thread, or by the thread already encoding
        it (waited for; where that one did not cache them, this one encodes them itself)."""
        key = hashlib.blake2b(content.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        while True:
            with self._lock:
                if key in self._ids:
                    self._ids.move_to_end(key)
                    return self._ids[key]
                busy = self._encoding.get(key)
                if busy is None:
                    busy = self._encoding[key] = threading.Event()
                    break
            busy.wait()
        try:
            ids = array("i", self.tok.encode_plain(content))
            with self._lock:
                if len(ids) <= self.max_ids:
                    self._ids[key] = ids
                    self._held += len(ids)
                    while self._held > self.max_ids:
                        self._held -= len(self._ids.popitem(last=False)[1])
        finally:
            with self._lock:
                del self._encoding[key]
            busy.set()
        return ids
