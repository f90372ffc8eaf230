"""A real long document for the benchmarks: prose nobody here wrote, the same on every machine.

Python's language reference ships with every CPython as `pydoc_data.topics` (the text `help()`
shows: about 113K SmolLM2 tokens); past it, the help pages of standard modules follow, in a fixed
order, until the document is long enough. Its text depends only on the Python version.
"""

from __future__ import annotations

import importlib
import pydoc

MODULES = (
    "builtins", "collections", "itertools", "functools", "os", "pathlib", "re", "json", "datetime",
    "threading", "subprocess", "socket", "asyncio", "typing", "dataclasses", "argparse", "logging",
    "unittest", "sqlite3", "email", "http.client", "urllib.request", "xml.etree.ElementTree",
)  # fmt: skip


def sections() -> list[str]:
    from pydoc_data.topics import topics

    out = [topics[k] for k in sorted(topics)]
    for name in MODULES:
        out.append(pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext))
    return out


def reference_text(n_tokens: int, tokenizer) -> str:
    """The reference's first n_tokens tokens (by the model's tokenizer), as text."""
    parts: list[str] = []
    ids: list[int] = []
    for text in sections():
        parts.append(text)
        ids += tokenizer.encode_plain(text + "\n\n")
        if len(ids) >= n_tokens:
            break
    return tokenizer.decode(ids[:n_tokens])
