"""`kvflash ask` and `kvflash chat`: long-document sessions from the terminal, run here or, with
--server, on a running `kvflash serve` (then nothing heavy is imported: torch and the engine load
inside the functions that run a local session, and rich inside those that draw progress bars or
read the terminal)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kvflash import KVFlashError
from kvflash.cli.engine_options import ENGINE, FLAGS, EngineOptions, engine_command, open_engine
from kvflash.cli.messages import warn
from kvflash.cli.options import JsonOpt, StoreOpt
from kvflash.serve.documents import Document
from kvflash.text_file import read_text

if TYPE_CHECKING:
    from kvflash.serve.client import Conversation, Server
    from kvflash.serve.session import Session
    from kvflash.serve.turn import TurnStats

DocsArg = typer.Argument(..., help="Document files (UTF-8 text).", show_default=False)
SessionOpt = typer.Option(None, "--session", "-s", help="Name a conversation to resume it later.")
LazyOpt = typer.Option(None, "--lazy/--eager", help="Restore lazily (default: when KV exceeds the budget).")
MaxTokOpt = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens per answer.")
PinOpt = typer.Option(
    None,
    "--pin",
    help="Keep resident: system, last-turn, or [DOC:]START:END characters of a document (repeatable).",
)
NoStoreOpt = typer.Option(False, "--no-store", help="Neither restore from nor save to the snapshot store.")
ServerOpt = typer.Option(
    None, "--server", envvar="KVFLASH_SERVER",
    help="URL of a running `kvflash serve`: run the turn there, loading no model here.",
)  # fmt: skip
ProcsOpt = typer.Option(
    0, "--store-processes", "--decode-processes", min=0,
    help="Encode saves and decode restores in N worker processes (0: the store's threads); restores "
    "paid off from 12 on 16 cores, a server of 32 conversations ran slower with 16 (more cores busy).",
)  # fmt: skip


def read_documents(paths: list[Path]) -> list[Document]:
    return [Document(p.name, read_text(p)) for p in paths]


def open_session(
    docs: list[Path], engine: EngineOptions, *, session: str | None, lazy: bool | None, store: Path | None,
    no_store: bool, store_processes: int = 0, pins: list[str] | None = None, prefetch: bool = True,
) -> Session:  # fmt: skip
    """The session `ask` and `chat` run, from their options. `ask` answers one question and exits, so
    it prefetches nothing for a next one (`Session`)."""
    from kvflash.paths import snapshots_dir
    from kvflash.serve.pins import parse_pin
    from kvflash.serve.session import Session
    from kvflash.storage import SnapshotStore, StoreError

    pinned = [parse_pin(p) for p in pins or ()]  # a bad --pin fails before the model loads
    documents = read_documents(docs)
    _, eng = open_engine(engine, warm=False)
    st = None
    if not no_store:
        try:
            st = SnapshotStore(store or snapshots_dir(), processes=store_processes)
        except StoreError as e:  # the store only saves time: answer without it
            warn(f"snapshot store unusable, answering without it: {e}")
    try:
        sess = Session(eng, documents, st, name=session, lazy=lazy, pins=pinned, prefetch=prefetch)
        eng.warm_up()  # while the session reads its stored documents' ids and summaries
        return sess
    except BaseException:
        if st is not None:  # its threads and worker processes: close_session never sees this one
            st.close()
        raise


def close_session(sess: Session) -> None:
    """The session, then the store open_session made for it (its threads and worker processes)."""
    sess.close()
    if sess.snapshots is not None:
        sess.snapshots.store.close()


def stats_line(s: dict) -> str:
    """One line from a turn's stats (TurnStats.to_dict(), or a server response's `kvflash` field)."""
    if not s:
        return "no stats: the server sent no kvflash field"
    mib = {k: v / 2**20 for k, v in s.get("bytes_moved", {}).items()}
    return (
        f"TTFT {s['ttft_s']:.2f}s ({s['source']}) | restored {s['restored_tokens']} tok, prefilled "
        f"{s['prefilled_tokens']} tok | read disk {mib.get('disk', 0):.1f} MiB, host->gpu "
        f"{mib.get('host_to_gpu', 0):.1f} MiB | decode {s['decode_tok_s']:.1f} tok/s, "
        f"{s['generated_tokens']} tok"
        + (f" | pinned {s['pinned_chunks']} chunks" if s.get("pinned_chunks") else "")
    )


def print_stats(stats: dict) -> None:
    """The stats line on stdout, dim on a terminal: written without rich, which `ask --server` would
    import for this line alone."""
    line = stats_line(stats)
    styled = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    print(f"\x1b[2m{line}\x1b[0m" if styled else line)


def run_turn(sess: Session, question: str, max_tokens: int, stream: bool) -> tuple[str, TurnStats]:
    """One turn with a prefill progress bar and, when stream is set, tokens printed as they come."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvflash.engine.generate import Sampling
    from kvflash.models.tokenizer import StreamDecoder

    decoder = StreamDecoder(sess.tok)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True, redirect_stdout=False, redirect_stderr=False,
    ) as bar:  # fmt: skip
        restore = bar.add_task("restore", total=None, visible=False)
        task = bar.add_task("prefill", total=None)

        def on_restore(done: int, total: int) -> None:
            bar.update(restore, completed=done, total=total, visible=True)

        def on_prefill(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        def on_text(tok: int) -> None:
            if bar.live.is_started:
                bar.stop()
            if stream:
                sys.stdout.write(decoder.push(tok))
                sys.stdout.flush()

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            text, stats = sess.ask(question, max_tokens, Sampling(), on_text, on_prefill, on_restore)
    for w in caught:
        warn(w.message)
    if stream:
        print(decoder.flush())
    return text, stats


LOCAL_ENGINE = ("model", "dtype", "kv_dtype", "device", "pool_tokens")
"""Engine options --server refuses, with store, lazy, store_processes, no_store and pin: they
configure a local engine, and a server has its own."""


def refuse_local_options(engine: EngineOptions, **given: object) -> None:
    """One line naming the first local-engine option given alongside --server."""
    named = {FLAGS[name]: getattr(engine, name) for name in LOCAL_ENGINE}
    named.update({"--" + name.replace("_", "-"): value for name, value in given.items()})
    for flag, value in named.items():
        if value not in (None, False, 0, [], ()):
            raise KVFlashError(f"{flag} configures a local engine; the server at --server has its own")


class Remote:
    """The conversation a thin client keeps, and the server that answers it."""

    def __init__(self, url: str, docs: list[Path], session: str | None):
        from kvflash.serve.client import Conversation, Server

        self.conv: Conversation = Conversation(read_documents(docs), session)
        self.server: Server = Server(url)

    def turn(self, question: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
        def on_text(piece: str) -> None:
            if stream:
                sys.stdout.write(piece)
                sys.stdout.flush()

        reply = self.server.chat(self.conv.messages(question), max_tokens, on_text)
        if stream:
            print()
        self.conv.add(question, reply.text)
        return reply.text, reply.stats


def remote(url: str, docs: list[Path], session: str | None) -> Remote:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = Remote(url, docs, session)
    for w in caught:
        warn(w.message)
    return r


@engine_command()
def ask(
    docs: list[Path] = DocsArg,
    question: str = typer.Argument(..., help="The question (after the documents).", show_default=False),
    session: str = SessionOpt,
    server: str = ServerOpt,
    engine: EngineOptions = ENGINE,
    lazy: bool = LazyOpt,
    max_tokens: int = MaxTokOpt,
    pin: list[str] = PinOpt,
    store: Path = StoreOpt,
    no_store: bool = NoStoreOpt,
    store_processes: int = ProcsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Ask QUESTION about DOCS; restores what an earlier turn stored and prints a stats line."""
    from kvflash.serve.client import server_url

    if url := server_url(server):
        refuse_local_options(engine, store=store, lazy=lazy, store_processes=store_processes,
                             no_store=no_store, pin=pin)  # fmt: skip
        text, stats = remote(url, docs, session).turn(question, max_tokens, stream=not as_json)
    else:
        sess = open_session(
            docs, engine, session=session, lazy=lazy, store=store, no_store=no_store,
            store_processes=store_processes, pins=pin, prefetch=False,
        )  # fmt: skip
        try:
            text, turn_stats = run_turn(sess, question, max_tokens, stream=not as_json)
        finally:
            close_session(sess)
        stats = turn_stats.to_dict()
    if as_json:
        print(json.dumps({"answer": text, **stats}))
    else:
        print_stats(stats)


@engine_command()
def chat(
    docs: list[Path] = DocsArg,
    session: str = SessionOpt,
    server: str = ServerOpt,
    engine: EngineOptions = ENGINE,
    lazy: bool = LazyOpt,
    max_tokens: int = MaxTokOpt,
    pin: list[str] = PinOpt,
    store: Path = StoreOpt,
    store_processes: int = ProcsOpt,
) -> None:
    """Interactive multi-turn chat about DOCS. Commands: /stats, /reset, /save, /quit."""
    from rich.console import Console

    from kvflash.serve.client import server_url

    console = Console(highlight=False)
    if url := server_url(server):
        refuse_local_options(engine, store=store, lazy=lazy, store_processes=store_processes, pin=pin)
        r = remote(url, docs, session)
        turns, sess = len(r.conv.turns) // 2, None
    else:
        sess = open_session(
            docs, engine, session=session, lazy=lazy, store=store, no_store=False,
            store_processes=store_processes, pins=pin,
        )  # fmt: skip
        turns = len(sess.messages) // 2
    last: dict | None = None
    console.print(
        f"[dim]{turns} earlier turns resumed[/]"
        if turns
        else "[dim]new conversation; /stats /reset /save /quit[/]"
    )
    try:
        while True:
            try:
                line = console.input("[bold]> [/]").strip()
            except EOFError:
                break
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line == "/stats":
                console.print(stats_line(last) if last else "no turn yet")
            elif line == "/reset":
                if sess is None:
                    r.conv.reset()
                else:
                    sess.reset()
                console.print("[dim]conversation reset[/]")
            elif line == "/save" and sess is None:
                console.print("[dim]the server snapshots every turn[/]")
            elif line == "/save" and sess.snapshots is None:
                console.print("[dim]no snapshot store to save in (--no-store, or one that could not open)[/]")
            elif line == "/save":
                sid = sess.save() if sess.kv is not None else None
                console.print(f"[dim]saved snapshot {sid}[/]" if sid else "[dim]nothing to save[/]")
            elif line.startswith("/"):
                console.print(f"unknown command {line}; try /stats /reset /save /quit", markup=False)
            else:
                if sess is None:
                    _, last = r.turn(line, max_tokens, stream=True)
                else:
                    _, stats = run_turn(sess, line, max_tokens, stream=True)
                    last = stats.to_dict()
                console.print(f"[dim]{stats_line(last)}[/]", soft_wrap=True)
    finally:
        if sess is not None:
            close_session(sess)
