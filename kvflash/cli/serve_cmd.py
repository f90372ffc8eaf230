"""`kvflash serve`: the OpenAI-compatible server (kvflash.serve.routes) on uvicorn."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer

from kvflash.cli.ask_cmd import ProcsOpt
from kvflash.cli.engine_options import ENGINE, EngineOptions, engine_command, open_engine
from kvflash.cli.messages import warn
from kvflash.cli.options import SharedStoreOpt, StoreOpt
from kvflash.cli.snapshot_cmd import parse_size
from kvflash.serve.snapshots import KVSnapshots
from kvflash.storage.tiered import TierConfig, open_tiers

SHUTDOWN_GRACE_S = 5
"""How long a stopping server lets open requests finish before it ends them."""


@engine_command()
def serve(
    engine: EngineOptions = ENGINE,
    store: Path = StoreOpt,
    shared_store: str = SharedStoreOpt,
    cache_bytes: str = typer.Option(
        None,
        "--store-max-bytes",
        metavar="SIZE",
        help="With both stores: the local one's budget (e.g. 20G); least recently used snapshots "
        "leave it once copied to the shared store.",
    ),
    no_store: bool = typer.Option(False, "--no-store", help="Keep no KV across requests on disk."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="TCP port."),
    name: str = typer.Option(
        None,
        "--served-model-name",
        help="Model id in requests (default: the GGUF's name up to its quantisation, or the directory's).",
    ),
    max_tokens: int = typer.Option(512, "--max-tokens", min=1, help="Answer length if a request sets none."),
    max_batch: int = typer.Option(
        32,
        "--max-batch",
        min=1,
        help="Most requests run together; each is admitted when the pool has room for its prompt and answer.",
    ),
    sequence_tokens: int = typer.Option(
        None,
        "--sequence-tokens",
        min=1,
        help="Most pool tokens one request holds; a longer context evicts (default: the pool, to 262,144).",
    ),
    max_waiting: int = typer.Option(
        256,
        "--max-waiting",
        min=1,
        help="Requests that may wait for admission; more get 429 with Retry-After.",
    ),
    max_prompt_tokens: int = typer.Option(
        None,
        "--max-prompt-tokens",
        min=1,
        help="Longest prompt; longer ones get 400 (default: what one sequence can hold).",
    ),
    request_timeout: float = typer.Option(
        None,
        "--request-timeout",
        min=0.001,
        help="Seconds a request may take: one with no token by then gets 504, an answer ends there.",
    ),
    api_key: str = typer.Option(
        None, "--api-key", envvar="KVFLASH_API_KEY", help="Require `Authorization: Bearer KEY` (not /health)."
    ),
    store_processes: int = ProcsOpt,
) -> None:
    """Serve /v1/chat/completions and /v1/models; a conversation's next turn reuses its KV.

    With --shared-store, snapshots go to Redis too, so a conversation restores on whichever server
    its next turn reaches; with --store as well, that directory is a local cache in front of it."""
    import uvicorn

    from kvflash.serve.routes import create_app  # FastAPI loads only for `serve`
    from kvflash.serve.server import Server

    tiers = TierConfig(cache_bytes=parse_size(cache_bytes) if cache_bytes else None)  # before the load
    lm, eng = open_engine(engine)
    st = None if no_store else open_tiers(store, shared_store, store_processes, tiers)
    snapshots = KVSnapshots(st, eng.fingerprint, other_kv=eng.other_kv_fingerprints()) if st else None
    for stored, n in (snapshots.other_kv_counts() if snapshots else {}).items():
        warn(f"the store holds {n} snapshots of this model with {stored} KV; this server keeps "
             f"{eng.kv_dtype_name} KV (--kv-dtype) and restores none of them")  # fmt: skip
    model_name = name or served_name(lm.path)
    server = Server(
        eng,
        lm.tokenizer,
        model_name,
        snapshots,
        max_tokens,
        max_batch,
        max_prompt_tokens,
        max_waiting,
        sequence_tokens,
        request_timeout,
    )
    # uvicorn stops on SIGTERM, then raises it again: the default action would end the process
    # before the answers in flight are ended and their snapshots written (Server.close, below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # on SIGTERM or Ctrl-C, requests still open after the grace period are ended (Server.close)
        uvicorn.run(create_app(server, api_key=api_key), host=host, port=port, log_level="info",
                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S)  # fmt: skip
    finally:
        server.close()
        if st is not None:
            st.close()


def served_name(path: Path) -> str:
    """The model id a server answers to by default: an HF directory's name, a GGUF file's name up to
    its quantisation (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`), whatever dots the
    model's own name has (`Qwen2.5-7B-Instruct`)."""
    if path.is_dir():
        return path.name
    stem = path.name.removesuffix(".gguf")
    head, dot, tail = stem.rpartition(".")
    return head if dot and tail and tail[0] in "QqFfBbIi" and any(ch.isdigit() for ch in tail) else stem
