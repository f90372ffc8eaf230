"""`kvflash snapshot list|inspect|verify|prune|pin|unpin|rm|du`: a snapshot store by hand, on disk
(`--store`) or the tier several servers share on Redis (`--shared-store`)."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict
from decimal import Decimal
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from kvflash import KVFlashError
from kvflash.cli.messages import warn
from kvflash.cli.options import JsonOpt, ModelOpt, SharedStoreOpt
from kvflash.paths import kvflash_home
from kvflash.storage import ChunkError, PruneReport, SnapshotStore
from kvflash.storage.chunk import KV_DTYPES

app = typer.Typer(help="Inspect and manage saved KV snapshots.", no_args_is_help=True)

StoreOpt = typer.Option(None, "--store", help="Store directory (default: $KVFLASH_HOME/snapshots).")

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_SIZE = 1 << 62
MAX_AGE_S = 1000 * 365 * 86400


def default_store() -> Path:
    return kvflash_home() / "snapshots"


def open_store(store: Path | None, shared: str | None = None) -> SnapshotStore:
    """A typo in --store must not create a new empty store; only the default one is made on demand.
    With --shared-store, the Redis tier (a wrong password or an unreachable Redis is one line)."""
    if shared is not None:
        if store is not None:
            raise KVFlashError("give --store or --shared-store, not both")
        from kvflash.storage.redis_store import RedisStore

        return RedisStore(shared)
    root = store if store is not None else default_store()
    if store is not None and not (root / "index.sqlite").exists():
        raise KVFlashError(f"no snapshot store at {root}")
    return SnapshotStore(root)


def parse_size(text: str) -> int:
    """`10G`, `500M`, `1.5GiB`, `4096`: binary units."""
    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise KVFlashError(f"not a size: {text!r:.60} (examples: 10G, 500M, 4096)")
    n = int(Decimal(m.group(1)) * _UNITS[m.group(2).upper()])
    if n > MAX_SIZE:
        raise KVFlashError(f"size {text.strip()} is above {MAX_SIZE >> 60} EiB")
    return n


def parse_age(text: str) -> float:
    """`7d`, `12h`, `30m`, `45s`, `2w`."""
    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([smhdw])\s*", text, re.IGNORECASE)
    if not m:
        raise KVFlashError(f"not an age: {text!r:.60} (examples: 7d, 12h, 30m)")
    age = float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]
    if not math.isfinite(age) or age > MAX_AGE_S:
        raise KVFlashError(f"age {text.strip()} is above 1000 years")
    return age


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _emit(as_json: bool, payload: object, human: Callable[[Console], None]) -> None:
    if as_json:
        print(json.dumps(payload))
    else:
        human(Console(highlight=False))


@app.command("list")
def list_(
    store: Path = StoreOpt,
    shared_store: str = SharedStoreOpt,
    wide: bool = typer.Option(False, "--wide", help="All columns: chunks, ratio, created, pinned too."),
    as_json: bool = JsonOpt,
) -> None:
    """Every snapshot: id, label, tokens, bytes on disk, last use and hits (--wide: all the facts)."""
    with open_store(store, shared_store) as st:
        snaps = st.list_snapshots()
    rows = [asdict(s) | {"ratio": round(s.ratio, 3)} for s in snaps]

    def human(con: Console) -> None:
        con.print(_list_table(snaps, wide) if snaps else "no snapshots")

    _emit(as_json, rows, human)


def _list_table(snaps: list, wide: bool) -> Table:
    """By default six columns that read at 80 characters (a pinned id carries a *, the last use drops
    the year); wide, every fact."""
    if wide:
        t = Table(Column("id", no_wrap=True), "label", "tokens", "chunks", "on disk", "ratio")
        for col in ("created", "last used", "hits", "pinned"):
            t.add_column(col)
        for s in snaps:
            t.add_row(
                s.id, Text(s.label), f"{s.n_tokens:,}", str(s.n_chunks), _bytes(s.stored_bytes),
                f"{s.ratio:.2f}x", _when(s.created), _when(s.last_used), str(s.hits),
                "yes" if s.pinned else "",
            )  # fmt: skip
        return t
    t = Table(box=None, pad_edge=False, caption="* pinned" if any(s.pinned for s in snaps) else None)
    t.add_column("id", no_wrap=True)
    t.add_column("label", overflow="fold")
    for col in ("tokens", "on disk", "last used", "hits"):
        t.add_column(col, justify="right", no_wrap=True)
    for s in snaps:
        pin, used = "*" if s.pinned else "", time.strftime("%m-%d %H:%M", time.localtime(s.last_used))
        t.add_row(s.id + pin, Text(s.label), f"{s.n_tokens:,}", _bytes(s.stored_bytes), used, str(s.hits))
    return t


def inspect_snapshot(
    st: SnapshotStore, snapshot_id: str, decode_tokens: Callable[[list[int]], str] | None = None
) -> dict:
    """Facts about one snapshot: its index record, the first chunk's header, a row per chunk, and
    (given a detokenizer) its text."""
    snap = st.get_snapshot(snapshot_id)
    rows = st.index.chunk_rows(snap.chunk_hashes)
    facts = asdict(snap) | {"ratio": round(snap.ratio, 3)}
    facts["chunk_hashes"] = list(snap.chunk_hashes)
    try:
        h = st.read_header(snap.chunk_hashes[0])
        facts["header"] = {
            "format_version": h.version,
            "codec": h.codec.name.lower(),
            "dtype": str(h.dtype).removeprefix("torch."),
            "shape": list(h.shape),
            "chunk_tokens": h.n_tokens,
        }
    except ChunkError as e:
        facts["header"] = {"error": str(e)}
    facts["chunks"] = [
        {
            "position": i,
            "hash": h,
            "codec": rows[h].codec,
            "stored_bytes": rows[h].stored_bytes,
            "raw_bytes": rows[h].raw_bytes,
            "refcount": rows[h].refcount,
            "damaged": rows[h].damaged,
        }
        for i, h in enumerate(snap.chunk_hashes)
    ]
    if decode_tokens is not None:
        blobs = st.read_chunks_parallel(snap.chunk_hashes, snap.fingerprint, with_summary=False)
        facts["text"] = decode_tokens([t for b in blobs for t in b.tokens])
    return facts


def _tokenizer_for(model: Path | None, fingerprint: str, chunk_tokens: int) -> Callable[[list[int]], str]:
    """Loaded only for --text: the model load is the slow part of inspect."""
    from kvflash.models.loader import load_model

    lm = load_model(model, device="cpu", need_tokenizer=True)
    if all(lm.fingerprint(chunk_tokens, dt) != fingerprint for dt in KV_DTYPES):
        warn("this model's fingerprint differs from the snapshot's; the text may be wrong")
    return lm.tokenizer.decode


@app.command()
def inspect(
    snapshot_id: str = typer.Argument(..., help="Snapshot id (see `kvflash snapshot list`)."),
    text: bool = typer.Option(False, "--text", help="Also show the decoded tokens (loads the model)."),
    model: Path = ModelOpt,
    store: Path = StoreOpt,
    shared_store: str = SharedStoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Header, fingerprint, codec and a per-chunk table of one snapshot."""
    with open_store(store, shared_store) as st:
        decode = None
        if text:
            snap = st.get_snapshot(snapshot_id)
            decode = _tokenizer_for(model, snap.fingerprint, snap.n_tokens // snap.n_chunks)
        facts = inspect_snapshot(st, snapshot_id, decode)

    def human(con: Console) -> None:
        t = Table(show_header=False, box=None)
        for k in ("id", "label", "fingerprint", "n_tokens", "n_chunks", "pinned", "hits", "meta"):
            t.add_row(k.replace("_", " "), Text(str(facts[k])))
        t.add_row("created", _when(facts["created"]))
        t.add_row("last used", _when(facts["last_used"]))
        t.add_row("on disk", f"{_bytes(facts['stored_bytes'])} ({facts['ratio']:.2f}x)")
        for k, v in facts["header"].items():
            t.add_row(k.replace("_", " "), Text(str(v)))
        con.print(t)
        c = Table("pos", Column("hash", no_wrap=True), "codec", "stored", "raw", "ratio", "refs", "damaged")
        for r in facts["chunks"]:
            stored, raw = r["stored_bytes"], r["raw_bytes"]
            c.add_row(
                str(r["position"]), r["hash"][:16], r["codec"], _bytes(stored), _bytes(raw),
                f"{raw / stored:.2f}x" if stored else "-", str(r["refcount"]), Text(r["damaged"] or ""),
            )  # fmt: skip
        con.print(c)
        if "text" in facts:
            con.print(facts["text"], markup=False)

    _emit(as_json, facts, human)


@app.command()
def verify(
    snapshot_id: str = typer.Argument(None, help="Snapshot id; or --all."),
    all_: bool = typer.Option(False, "--all", help="Every chunk in the store, and the index's refcounts."),
    store: Path = StoreOpt,
    shared_store: str = SharedStoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Checksums and hash chain; exits 1 naming each damaged chunk. Names each bad summaries file too
    (nothing is lost: those restores read the chunk files) and writes it again."""
    if (snapshot_id is None) == (not all_):
        raise KVFlashError("give a snapshot id or --all (not both)")
    with open_store(store, shared_store) as st:
        report = st.verify(None if all_ else snapshot_id)
    payload = asdict(report) | {"ok": report.ok}

    def human(con: Console) -> None:
        con.print(f"checked {report.checked_chunks} chunks in {report.checked_snapshots} snapshots")
        for d in report.damaged:
            held = f" (in {', '.join(d.snapshots)})" if d.snapshots else ""
            con.print(Text.assemble(("damaged", "red"), f" chunk {d.chunk_hash}{held}: {d.reason}"))
        for e in report.index_errors:
            con.print(Text.assemble(("index:", "red"), f" {e}"))
        for d in report.summaries:
            held = ", ".join(d.snapshots)
            con.print(Text.assemble(("summaries file", "yellow"), f" of {held}: {d.reason}"))
        if report.orphan_files:
            con.print(
                f"{report.orphan_files} files ({_bytes(report.orphan_bytes)}) under chunks/ are named by no "
                "index row (a save was interrupted): `kvflash snapshot prune` removes them"
            )
        if report.ok:
            con.print(Text("ok", "green"))

    _emit(as_json, payload, human)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def prune(
    max_bytes: str = typer.Option(None, "--max-bytes", help="Byte budget, e.g. 10G or 500M (binary units)."),
    older_than: str = typer.Option(None, "--older-than", help="Remove snapshots unused this long: 7d, 12h."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would go; remove nothing."),
    store: Path = StoreOpt,
    shared_store: str = SharedStoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Least recently used first; pinned snapshots and chunks of restores in flight stay."""
    budget = parse_size(max_bytes) if max_bytes is not None else None
    age = parse_age(older_than) if older_than is not None else None
    with open_store(store, shared_store) as st:
        report = st.prune(max_bytes=budget, older_than=age, dry_run=dry_run)
    _emit(as_json, asdict(report), lambda con: con.print(_removal_line(report)))


@app.command()
def rm(
    snapshot_id: str, store: Path = StoreOpt, shared_store: str = SharedStoreOpt, as_json: bool = JsonOpt
) -> None:
    """Remove one snapshot and the chunks no other snapshot holds."""
    with open_store(store, shared_store) as st:
        report = st.rm(snapshot_id)
    _emit(as_json, asdict(report), lambda con: con.print(_removal_line(report)))


def _removal_line(r: PruneReport) -> str:
    verb = "would remove" if r.dry_run else "removed"
    ids = f" ({', '.join(r.snapshots)})" if r.snapshots else ""
    return (
        f"{verb} {len(r.snapshots)} snapshots{ids} and {r.chunks} chunks, {_bytes(r.freed_bytes)}; "
        f"{_bytes(r.remaining_bytes)} stored"
    )


@app.command()
def pin(
    snapshot_id: str, store: Path = StoreOpt, shared_store: str = SharedStoreOpt, as_json: bool = JsonOpt
) -> None:
    """Keep a snapshot through every prune."""
    _set_pin(snapshot_id, True, open_store(store, shared_store), as_json)


@app.command()
def unpin(
    snapshot_id: str, store: Path = StoreOpt, shared_store: str = SharedStoreOpt, as_json: bool = JsonOpt
) -> None:
    """Let prune remove a snapshot again."""
    _set_pin(snapshot_id, False, open_store(store, shared_store), as_json)


def _set_pin(snapshot_id: str, pinned: bool, opened: SnapshotStore, as_json: bool) -> None:
    with opened as st:
        (st.pin if pinned else st.unpin)(snapshot_id)
    word = "pinned" if pinned else "unpinned"
    _emit(as_json, {"id": snapshot_id, "pinned": pinned}, lambda con: con.print(f"{word} {snapshot_id}"))


@app.command()
def du(store: Path = StoreOpt, shared_store: str = SharedStoreOpt, as_json: bool = JsonOpt) -> None:
    """Bytes on disk: chunk files (compressed and raw), summaries files, unreferenced chunks, the index."""
    with open_store(store, shared_store) as st:
        usage = st.du()
    payload = asdict(usage) | {"ratio": round(usage.ratio, 3)}

    def human(con: Console) -> None:
        t = Table(show_header=False, box=None)
        t.add_row("store", Text(usage.root))
        t.add_row("snapshots", f"{usage.snapshots} ({usage.pinned} pinned)")
        t.add_row("chunks", f"{usage.chunks} ({usage.damaged_chunks} damaged)")
        t.add_row(
            "chunk files", f"{_bytes(usage.stored_bytes)} ({usage.ratio:.2f}x of {_bytes(usage.raw_bytes)})"
        )
        t.add_row("summaries files", f"{usage.summaries_files} ({_bytes(usage.summaries_bytes)})")
        t.add_row("unreferenced", _bytes(usage.unreferenced_bytes))
        t.add_row("orphan files", f"{usage.orphan_files} ({_bytes(usage.orphan_bytes)})")
        t.add_row("index", _bytes(usage.index_bytes))
        con.print(t)

    _emit(as_json, payload, human)
