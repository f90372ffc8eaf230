"""kvflash: long-document LLM sessions on GPUs smaller than the document's KV cache."""

__version__ = "0.1.0"


class KVFlashError(Exception):
    """An error meant for the user: the CLI prints its message on one line, without a traceback."""
