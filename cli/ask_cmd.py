"""`kvflash ask` and `kvflash chat`: long-document sessions from the terminal."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from kvflash import KVFlashError
from kvflash.cli.options import DeviceOpt, DtypeOpt, HostBytesOpt, JsonOpt, ModelOpt, StoreOpt
from kvflash.config import POLICIES, EngineConfig, ResidencyConfig
from kvflash.engine import Engine
from kvflash.generate import Sampling
from kvflash.models.loader import load_model
from kvflash.models.tokenizer import StreamDecoder
from kvflash.paths import snapshots_dir
from kvflash.session import Document, Session
from kvflash.storage import SnapshotStore
from kvflash.turn import TurnStats

DocsArg = typer.Argument(..., help="Document files (UTF-8 text).", show_default=False)
SessionOpt = typer.Option(None, "--session", "-s", help="Name a conversation to resume it later.")
PoolOpt = typer.Option(
    None, "--pool-tokens", help="GPU KV budget in tokens (default: 16384; 'auto' on CUDA)."
)
PolicyOpt = typer.Option("qk", "--policy", help=f"Residency policy: {', '.join(POLICIES)}.")
AbsolutePositionsOpt = typer.Option(
    False, "--absolute-positions", help="Attend at absolute positions, not positions within the cache."
)
LazyOpt = typer.Option(None, "--lazy/--eager", help="Restore lazily (default: when KV exceeds the budget).")
MaxTokOpt = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens per answer.")
NoStoreOpt = typer.Option(False, "--no-store", help="Neither restore from nor save to the snapshot store.")
GraphsOpt = typer.Option(
    True, "--cuda-graphs/--no-cuda-graphs", help="Replay each decode step from a CUDA graph (on CUDA)."
)
ProcsOpt = typer.Option(
    0, "--decode-processes", min=0,
    help="Decode restores in N worker processes (0: the store's threads); paid off from 12 on 16 cores.",
)  # fmt: skip


def read_documents(paths: list[Path]) -> list[Document]:
    docs = []
    for p in paths:
        try:
            docs.append(Document(p.name, p.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise KVFlashError(f"document not found: {p}") from None
        except (UnicodeDecodeError, IsADirectoryError) as e:
            raise KVFlashError(f"{p}: not a UTF-8 text file ({e.__class__.__name__})") from None
    return docs


def pool_tokens(value: str | None) -> int | str:
    if value is None:
        return 16384
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise KVFlashError(f"--pool-tokens takes a number of tokens or 'auto', not {value!r}") from None
    if n < 1:
        raise KVFlashError("--pool-tokens must be positive")
    return n


def open_session(
    docs: list[Path], *, session: str | None, pool: str | None, policy: str, lazy: bool | None,
    model: Path | None, dtype: str | None, device: str | None, store: Path | None, no_store: bool,
    absolute_positions: bool = False, decode_processes: int = 0, cuda_graphs: bool = True,
    host_bytes: int = EngineConfig.host_bytes,
) -> Session:  # fmt: skip
    """The session `ask` and `chat` run, from their options (keywords: a dozen of them)."""
    documents = read_documents(docs)
    lm = load_model(model, dtype=dtype, device=device)
    budget = pool_tokens(pool)
    res = ResidencyConfig(policy=policy, cache_positions=not absolute_positions)
    cfg = EngineConfig(pool_tokens=budget, host_bytes=host_bytes, residency=res, cuda_graphs=cuda_graphs)
    engine = Engine(lm, cfg)
    st = None if no_store else SnapshotStore(store or snapshots_dir(), processes=decode_processes)
    try:
        return Session(engine, documents, st, name=session, lazy=lazy)
    except BaseException:
        if st is not None:  # its threads and decode workers: close_session never sees this one
            st.close()
        raise


def close_session(sess: Session) -> None:
    """The session, then the store open_session made for it (its threads and decode workers)."""
    sess.close()
    if sess.snapshots is not None:
        sess.snapshots.store.close()


def stats_line(s: TurnStats) -> str:
    mib = {k: v / 2**20 for k, v in s.bytes_moved.items()}
    return (
        f"TTFT {s.ttft_s:.2f}s ({s.source}) | restored {s.restored_tokens} tok, prefilled "
        f"{s.prefilled_tokens} tok | read disk {mib.get('disk', 0):.1f} MiB, host->gpu "
        f"{mib.get('host_to_gpu', 0):.1f} MiB | decode {s.decode_tok_s:.1f} tok/s, {s.generated_tokens} tok"
    )


def run_turn(
    sess: Session, question: str, max_tokens: int, console: Console, stream: bool
) -> tuple[str, TurnStats]:
    """One turn with a prefill progress bar and, when stream is set, tokens printed as they come."""
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
        Console(stderr=True).print(f"[yellow]warning:[/] {w.message}", highlight=False)
    if stream:
        print(decoder.flush())
    return text, stats


def ask(
    docs: list[Path] = DocsArg,
    question: str = typer.Argument(..., help="The question (after the documents).", show_default=False),
    session: str = SessionOpt,
    pool: str = PoolOpt,
    host_bytes: int = HostBytesOpt,
    policy: str = PolicyOpt,
    absolute_positions: bool = AbsolutePositionsOpt,
    lazy: bool = LazyOpt,
    max_tokens: int = MaxTokOpt,
    model: Path = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    store: Path = StoreOpt,
    no_store: bool = NoStoreOpt,
    decode_processes: int = ProcsOpt,
    cuda_graphs: bool = GraphsOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Ask QUESTION about DOCS; restores what an earlier turn stored and prints a stats line."""
    sess = open_session(
        docs, session=session, pool=pool, policy=policy, lazy=lazy, model=model, dtype=dtype,
        device=device, store=store, no_store=no_store, absolute_positions=absolute_positions,
        decode_processes=decode_processes, cuda_graphs=cuda_graphs, host_bytes=host_bytes,
    )  # fmt: skip
    console = Console(highlight=False)
    try:
        text, stats = run_turn(sess, question, max_tokens, console, stream=not as_json)
    finally:
        close_session(sess)
    if as_json:
        print(json.dumps({"answer": text, **stats.to_dict()}))
    else:
        console.print(f"[dim]{stats_line(stats)}[/]", soft_wrap=True)


def chat(
    docs: list[Path] = DocsArg,
    session: str = SessionOpt,
    pool: str = PoolOpt,
    host_bytes: int = HostBytesOpt,
    policy: str = PolicyOpt,
    absolute_positions: bool = AbsolutePositionsOpt,
    lazy: bool = LazyOpt,
    max_tokens: int = MaxTokOpt,
    model: Path = ModelOpt,
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    store: Path = StoreOpt,
    decode_processes: int = ProcsOpt,
    cuda_graphs: bool = GraphsOpt,
) -> None:
    """Interactive multi-turn chat about DOCS. Commands: /stats, /reset, /save, /quit."""
    sess = open_session(
        docs, session=session, pool=pool, policy=policy, lazy=lazy, model=model, dtype=dtype,
        device=device, store=store, no_store=False, absolute_positions=absolute_positions,
        decode_processes=decode_processes, cuda_graphs=cuda_graphs, host_bytes=host_bytes,
    )  # fmt: skip
    console = Console(highlight=False)
    last: TurnStats | None = None
    console.print(
        f"[dim]{len(sess.messages) // 2} earlier turns resumed[/]"
        if len(sess.messages) > 1
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
                sess.reset()
                console.print("[dim]conversation reset[/]")
            elif line == "/save":
                sid = sess.save() if sess.kv is not None else None
                console.print(f"[dim]saved snapshot {sid}[/]" if sid else "[dim]nothing to save[/]")
            elif line.startswith("/"):
                console.print(f"unknown command {line}; try /stats /reset /save /quit")
            else:
                _, last = run_turn(sess, line, max_tokens, console, stream=True)
                console.print(f"[dim]{stats_line(last)}[/]", soft_wrap=True)
    finally:
        close_session(sess)
