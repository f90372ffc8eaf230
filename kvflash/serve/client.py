"""A thin client of a running `kvflash serve`: one turn through its OpenAI API, streamed.

It imports neither torch nor the engine: the model, the KV and the snapshots live in the server.
As OpenAI clients do, it sends the whole conversation each turn; the server finds the conversation's
KV live (or in its snapshot) and prefills only the new question. A named session keeps its
conversation in $KVFLASH_HOME/client-sessions, so a later process sends the same history.

A turn is one request: the id of the model a server serves, which each request must name, is
remembered in $KVFLASH_HOME/client-models.json from the first time it was asked.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvflash import KVFlashError
from kvflash.paths import kvflash_home, write_whole
from kvflash.serve.documents import Document, system_message

CHAT = "/v1/chat/completions"
SERVER_ENV = "KVFLASH_SERVER"
API_KEY_ENV = "KVFLASH_API_KEY"
"""The key a server started with --api-key wants (`kvflash serve` reads the same variable)."""


def server_url(flag: str | None) -> str | None:
    """--server, else $KVFLASH_SERVER, else None (run locally)."""
    url = flag or os.environ.get(SERVER_ENV) or None
    return url.rstrip("/") if url else None


@dataclass
class Reply:
    text: str
    stats: dict = field(default_factory=dict)
    """The response's `kvflash` field: the server's TurnStats of this turn."""
    usage: dict = field(default_factory=dict)


class ModelNotServed(KVFlashError):
    """The server answered 404 model_not_found: it serves a model other than the one named."""


class Server:
    """The OpenAI API of one kvflash server; every failure is a KVFlashError of one line."""

    def __init__(self, url: str, timeout: float = 600.0):
        if not url.startswith(("http://", "https://")):
            raise KVFlashError(f"--server takes an http:// or https:// URL, not {url!r}")
        self.url, self.timeout = url, timeout
        self._model: str | None = None

    def chat(self, messages: list[dict], max_tokens: int, on_text: Callable[[str], None]) -> Reply:
        """One streamed, greedy completion: on_text gets each piece of the answer as it comes."""
        body = {
            "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        reply = Reply("")
        with self._post_chat(body) as r:
            for event in _events(r):
                if "error" in event:
                    raise KVFlashError(f"the server failed mid-answer: {event['error'].get('message')}")
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        reply.text += piece
                        on_text(piece)
                reply.stats = event.get("kvflash") or reply.stats
                reply.usage = event.get("usage") or reply.usage
        return reply

    def _post_chat(self, body: dict):
        """The chat request, naming the model remembered for this server; one the server refuses (it
        restarted with another model) is replaced by the one it lists, and the request sent again."""
        if self._model is None:
            self._model = remembered_models().get(self.url)
        if self._model is not None:
            try:
                return self._open(CHAT, {"model": self._model, **body})
            except ModelNotServed:
                pass
        self._model = self._listed_model()
        remember_model(self.url, self._model)
        return self._open(CHAT, {"model": self._model, **body})

    def _listed_model(self) -> str:
        """The id of the one model the server lists."""
        with self._open("/v1/models") as r:
            cards = json.load(r).get("data") or []
        if not cards:
            raise KVFlashError(f"the server at {self.url} lists no model")
        return cards[0]["id"]

    def _open(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + path, data, headers)
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            message, code = _error(e)
            kind = ModelNotServed if e.code == 404 and code == "model_not_found" else KVFlashError
            raise kind(f"the server at {self.url} answered {e.code}: {message}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise KVFlashError(f"cannot reach a kvflash server at {self.url} ({reason})") from None


def _events(response) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to [DONE]."""
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except json.JSONDecodeError:
            raise KVFlashError(f"the server sent an event that is not JSON: {data[:80]!r}") from None


def _error(e: urllib.error.HTTPError) -> tuple[str, str | None]:
    """An error answer's message and OpenAI error code."""
    try:
        body = json.loads(e.read())["error"]
        return str(body["message"]), body.get("code")
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return e.reason or "no message", None


def models_path() -> Path:
    return kvflash_home() / "client-models.json"


def remembered_models() -> dict[str, str]:
    """Server URL -> the model id it listed. The file only saves a request: one that is missing or
    unreadable counts as empty."""
    try:
        saved = json.loads(models_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    return {url: model for url, model in saved.items() if isinstance(model, str)}


def remember_model(url: str, model: str) -> None:
    """Added to the file; a failure to write it is ignored, as the file only saves a request."""
    try:
        write_whole(models_path(), json.dumps({**remembered_models(), url: model}))
    except OSError:
        pass


class Conversation:
    """The messages a client sends: the documents' system message, then the turns so far. A named
    one is saved after each turn and resumed by the next process, if its documents match."""

    def __init__(self, documents: list[Document], name: str | None = None):
        self.system = system_message(documents)
        self.docs = hashlib.sha256(self.system["content"].encode()).hexdigest()[:16]
        self.name = name
        self.turns: list[dict] = []
        if name:
            self._resume()

    @property
    def path(self) -> Path:
        key = hashlib.sha256(self.name.encode()).hexdigest()[:24]
        return kvflash_home() / "client-sessions" / f"{key}.json"

    def messages(self, question: str) -> list[dict]:
        return [self.system, *self.turns, {"role": "user", "content": question}]

    def add(self, question: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if self.name:
            self._save()

    def reset(self) -> None:
        self.turns = []
        if self.name:
            self._save()

    def _resume(self) -> None:
        try:
            saved = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            warnings.warn(
                f"session {self.name!r} is unreadable ({e}); starting a new conversation", stacklevel=3
            )
            return
        if not isinstance(saved, dict) or saved.get("docs") != self.docs:
            warnings.warn(
                f"session {self.name!r} was about other documents; starting a new conversation", stacklevel=3
            )
            return
        turns = saved.get("turns")
        if isinstance(turns, list) and all(
            isinstance(t, dict) and {"role", "content"} <= t.keys() for t in turns
        ):
            self.turns = turns

    def _save(self) -> None:
        """Written whole: a crash leaves the previous turn's file."""
        record = json.dumps({"name": self.name, "docs": self.docs, "turns": self.turns})
        try:
            write_whole(self.path, record)
        except OSError as e:
            raise KVFlashError(f"could not save session {self.name!r} in {self.path.parent}: {e}") from None
