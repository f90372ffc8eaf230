"""A server's memory over waves of requests: does `kvflash serve`'s RSS grow wave after wave (a leak)
or level off (a working set)?

A real `kvflash serve` process on 127.0.0.1 (the default model, on the CPU unless --device; a store
in a temporary folder) gets --waves waves of --requests concurrent requests from the `openai`
client, every other one streamed, each a new conversation over a document of --doc-tokens tokens
(--documents distinct ones, cycled: by default every request has its own). After each wave, once
the server holds no request and no snapshot waits for the disk, it records the server's VmRSS and
VmHWM (/proc/PID/status), the pool, host tier, live sequences and staged snapshots (/metrics), the
store's leases and bytes on disk; RSS is sampled every --interval s meanwhile, for the PNG.

The server hands malloc's free memory back once it has been idle a second (`Server` in
kvflash/serve/server.py): a row is taken --settle-s seconds after the wave has ended, so it shows what
the server holds, not what a burst left free. --inspect runs the server under bench/memory_report.py:
each wave's row then also has glibc malloc's figures, the bytes of live tensors by shape, object
counts by type and the thread count, and (with --tracemalloc) the Python allocations that grew since
the last wave.

With the server's default --host-bytes (8 GiB) RSS grows with every wave of new conversations until
the host tier is full (docs/RELIABILITY.md: Serving); --host-bytes 1073741824 shows it level off.

  python -m bench.server_memory --waves 8 --requests 30 --host-bytes 1073741824 --inspect \
      --out out/server_memory
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from rich.console import Console
from rich.table import Table

from bench.document import reference_text
from bench.harness import (
    free_port,
    out_dir,
    progress_bar,
    pyplot,
    run_meta,
    save_png,
    server_log,
    spawn_server,
    wait_until_serving,
    write_json,
)

MB = 1 << 20


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def metrics(url: str) -> dict[str, float]:
    """/metrics's unlabelled samples: name (without the kvflash_ prefix) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^kvflash_(\w+) (\S+)$", text, re.M)}


def store_usage(store: Path) -> dict[str, int]:
    """Bytes of the store's files and its leases (read from its index, read-only)."""
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    with sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True, timeout=30) as db:
        leases = db.execute("SELECT COUNT(*) FROM leases").fetchone()[0]
    return {"store_bytes": size, "leases": leases}


class ServerProcess:
    """`kvflash serve` (under bench.memory_report with `inspect`) in a child process, until `stop`."""

    def __init__(self, args, store: Path, inspect: bool):
        port = free_port()
        module = "bench.memory_report" if inspect else "kvflash.cli.app"
        cmd = [sys.executable, "-m", module, "serve", "--port", str(port), "--store", str(store),
               "--pool-tokens", str(args.pool_tokens), "--max-batch", str(args.max_batch),
               "--max-tokens", str(args.max_tokens)]  # fmt: skip
        cmd += ["--host-bytes", str(args.host_bytes)] if args.host_bytes else []
        cmd += ["--model", args.model] if args.model else []
        cmd += ["--device", args.device] if args.device else []
        env = dict(os.environ)
        if args.tracemalloc:
            env["KVFLASH_TRACEMALLOC"] = "16"
        if args.arena_max:
            env["MALLOC_ARENA_MAX"] = str(args.arena_max)
        self.proc = spawn_server(cmd, env)
        self.url = f"http://127.0.0.1:{port}"
        wait_until_serving(self.proc, self.url)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=3600)
        self.model = self.client.models.list().data[0].id

    def command(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def report(self, path: Path, timeout_s: float = 300) -> dict:
        """The server's own report (bench.memory_report), written to path."""
        self.command(f"report {path}")
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("the server wrote no memory report")
            time.sleep(0.1)
        return json.loads(path.read_text())

    def settle(self, idle_s: float, timeout_s: float = 600) -> dict[str, float]:
        """/metrics idle_s seconds after no request is in flight and no staged snapshot waits for
        the disk."""
        deadline = time.monotonic() + timeout_s
        while (m := metrics(self.url))["requests_in_flight"] or m["snapshots_unsaved"]:
            if time.monotonic() > deadline:
                raise SystemExit(f"the server did not settle: {m}")
            time.sleep(0.2)
        time.sleep(idle_s)
        return metrics(self.url)

    def stop(self, timeout_s: float = 120) -> str:
        """Stops the server; returns what it wrote to stderr."""
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout_s)
        return server_log(self.proc)


def documents(args) -> list[str]:
    """--documents documents of --doc-tokens tokens: windows of the reference text at as many
    offsets, each headed by its number (no two share a first chunk)."""
    from kvflash.models.loader import load_model

    tok = load_model(args.model, device="cpu").tokenizer
    ids = tok.encode_plain(reference_text(max(4 * args.doc_tokens, 131072), tok))
    stride = max(1, (len(ids) - args.doc_tokens) // max(1, args.documents - 1))
    return [f"Document {i}.\n" + tok.decode(ids[i * stride : i * stride + args.doc_tokens])
            for i in range(args.documents)]  # fmt: skip


QUESTIONS = ("What is this document about?", "Name one term it defines.", "Summarise it in a sentence.")


def ask(server: ServerProcess, doc: str, k: int, tokens: int) -> int:
    """Request k: a new conversation over doc, streamed when k is odd; its completion tokens."""
    messages = [
        {"role": "system", "content": doc},
        {"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]},
    ]
    kw = {"model": server.model, "messages": messages, "temperature": 0, "max_tokens": tokens}
    if k % 2:
        got = 0
        for chunk in server.client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        ):
            got = chunk.usage.completion_tokens if chunk.usage else got
        return got
    return server.client.chat.completions.create(**kw).usage.completion_tokens


class Sampler:
    """(seconds since start, VmRSS bytes) of a process every `interval` s, on a thread."""

    def __init__(self, pid: int, interval: float):
        self.pid, self.interval, self.t0 = pid, interval, time.monotonic()
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.series.append((self.now(), proc_status(self.pid)["VmRSS"]))
            except (FileNotFoundError, ProcessLookupError):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def row(server: ServerProcess, store: Path, wave: int, t: float, m: dict, args, reports: Path) -> dict:
    st = proc_status(server.proc.pid)
    r = {
        "wave": wave,
        "t_s": t,
        "rss": st["VmRSS"],
        "hwm": st["VmHWM"],
        "rss_anon": st["RssAnon"],
        "pool_slots_used": m["pool_slots_used"],
        "host_tier_slots_used": m["host_tier_slots_used"],
        "host_tier_bytes": m["host_tier_bytes_allocated"],
        "live_sequences": m["live_sequences"],
        "snapshots_unsaved": m["snapshots_unsaved"],
        **store_usage(store),
    }
    if args.inspect:
        rep = server.report(reports / f"wave{wave}.json")
        r.update(malloc=rep["malloc"], tensor_bytes=rep["tensor_bytes"], objects=rep["objects"],
                 threads=rep["threads"], report=f"wave{wave}.json")  # fmt: skip
    return r


def run(args, docs: list[str], reports: Path, progress) -> tuple[list[dict], list[tuple[float, int]]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        server = ServerProcess(args, store, args.inspect)
        sampler = Sampler(server.proc.pid, args.interval)
        rows = [row(server, store, 0, sampler.now(), server.settle(args.settle_s), args, reports)]
        task = progress.add_task("waves", total=args.waves)
        k = 0
        try:
            for wave in range(1, args.waves + 1):
                ks = range(k, k + args.requests)
                k += args.requests
                with ThreadPoolExecutor(args.requests) as pool:  # an error answer raises here
                    tokens = sum(pool.map(lambda j: ask(server, docs[j % len(docs)], j, args.max_tokens), ks))
                m = server.settle(args.settle_s)
                rows.append({**row(server, store, wave, sampler.now(), m, args, reports), "tokens": tokens})
                progress.advance(task)
        finally:
            sampler.stop()
            err = server.stop()
        if server.proc.returncode != 0:
            raise SystemExit(f"kvflash serve exited {server.proc.returncode}: {err[-2000:]}")
    return rows, sampler.series


def report(args, rows: list[dict]) -> None:
    t = Table(title=f"kvflash serve memory: {args.waves} waves x {args.requests} requests, "
                    f"{args.doc_tokens}-token documents, --max-batch {args.max_batch}")  # fmt: skip
    cols = ["wave", "RSS MB", "+ MB", "HWM MB", "host tier MB", "host slots", "pool slots", "live seqs",
            "store MB", "leases"]  # fmt: skip
    if args.inspect:
        cols += ["malloc free MB", "tensors MB", "objects", "threads"]
    for c in cols:
        t.add_column(c, justify="right")
    for i, r in enumerate(rows):
        grew = (r["rss"] - rows[i - 1]["rss"]) / MB if i else 0.0
        cells = [str(r["wave"]), f"{r['rss'] / MB:.0f}", f"{grew:+.0f}", f"{r['hwm'] / MB:.0f}",
                 f"{r['host_tier_bytes'] / MB:.0f}", f"{r['host_tier_slots_used']:.0f}",
                 f"{r['pool_slots_used']:.0f}", f"{r['live_sequences']:.0f}", f"{r['store_bytes'] / MB:.0f}",
                 str(r["leases"])]  # fmt: skip
        if args.inspect:
            cells += [f"{r['malloc']['free'] / MB:.0f}", f"{r['tensor_bytes'] / MB:.0f}", str(r["objects"]),
                      str(r["threads"])]  # fmt: skip
        t.add_row(*cells)
    Console().print(t)


def plot(rows: list[dict], series: list[tuple[float, int]], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t for t, _ in series], [v / MB for _, v in series], lw=1, label="VmRSS")
    ts = [r["t_s"] for r in rows]
    ax.plot(ts, [r["rss"] / MB for r in rows], "o", label="VmRSS after a wave")
    ax.plot(ts, [r["host_tier_bytes"] / MB for r in rows], "s--", label="host tier allocated")
    for r in rows:
        ax.axvline(r["t_s"], color="grey", lw=0.5)
    ax.set(xlabel="seconds", ylabel="MB", ylim=(0, None), title="kvflash serve memory, wave by wave")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--requests", type=int, default=30, help="concurrent requests per wave")
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument(
        "--documents", type=int, default=None, help="distinct documents (default: waves x requests)"
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--pool-tokens", type=int, default=4096)
    ap.add_argument(
        "--host-bytes", type=int, default=None, help="the server's --host-bytes (default: its own)"
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between RSS samples")
    ap.add_argument("--inspect", action="store_true", help="the server reports on its memory after each wave")
    ap.add_argument("--tracemalloc", action="store_true", help="with --inspect: Python allocations by line")
    ap.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before a wave's row")
    ap.add_argument("--arena-max", type=int, default=None, help="MALLOC_ARENA_MAX for the server")
    ap.add_argument("--out", default="out/server_memory")
    args = ap.parse_args()
    args.documents = args.documents or args.waves * args.requests
    if args.tracemalloc and not args.inspect:
        ap.error("--tracemalloc needs --inspect")
    out = out_dir(args.out)
    docs = documents(args)
    with progress_bar() as progress:
        rows, series = run(args, docs, out, progress)
    report(args, rows)
    write_json(out / "server_memory.json", {"meta": {**run_meta(), "args": vars(args)}, "rows": rows,
                                            "rss_series": series})  # fmt: skip
    plot(rows, series, out / "server_memory.png")
    Console().print(f"wrote {out / 'server_memory.json'} and {out / 'server_memory.png'}")


if __name__ == "__main__":
    main()
