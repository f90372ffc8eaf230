"""A bounded load test: --streams clients at once against one `kvflash serve` for --seconds, each
asking one request after another, a mix of long prompts (a new document of --long-tokens tokens as
system message, then a question) and short chats (a greeting), every other one streamed.

A real `kvflash serve` on 127.0.0.1 with a store in a temporary folder; the official `openai`
client, its streams in client processes of their own (bench/clients.py). The load runs in --phases
phases of --seconds each. After each phase, once nothing is in flight and no snapshot waits for the
disk, the row records /metrics (pool and host-tier slots in use, live sequences kept for reuse, pool
slots shared) and the store (bytes, leases). The server keeps idle sequences for reuse (they fill
the pool and host tier, and give way to new requests), so "back to baseline" means: no request,
lease or staged snapshot left after any phase, every pool and host-tier slot in use held by an idle
sequence (/metrics `*_slots_idle`), and the slots in use within the pool's and the host tier's
capacity. Errors are counted per kind (an answer that is an error, or a connection that fails); the
target is none.

  python -m bench.serve_load --streams 64 --seconds 60 --phases 2 --device cuda --out out/serve_load
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.clients import Users, default_processes, now
from bench.harness import out_dir, progress_bar, pyplot, run_meta, save_png, write_json
from bench.server_memory import QUESTIONS, ServerProcess, documents, store_usage

KEPT = ("pool_slots_used", "host_tier_slots_used", "live_sequences")
"""What a phase leaves: the idle sequences kept for reuse and the slots they hold."""
IDLE = ("pool_slots_idle", "host_tier_slots_idle")
"""Of those slots, the ones idle sequences hold: with nothing in flight, all of them."""
CAPACITY = ("pool_slots", "host_tier_slots")
SETTLED = ("requests_in_flight", "snapshots_unsaved")


def one_request(client, model: str, doc: str | None, k: int, tokens: int) -> tuple[str, float, int]:
    """Request k (streamed when k is odd): over doc, or a short chat when doc is None. Returns the
    kind, the seconds to its first text (the whole answer when not streamed) and its tokens."""
    if doc is None:
        kind, messages = "short", [{"role": "user", "content": f"Hi, I am visitor {k}. How are you?"}]
    else:
        kind = "long"
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[k % 3]}]
    kw = {"model": model, "messages": messages, "temperature": 0, "max_tokens": tokens}
    t0 = time.perf_counter()
    if not k % 2:
        usage = client.chat.completions.create(**kw).usage
        return kind, time.perf_counter() - t0, usage.completion_tokens
    first, got = None, 0
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        got = chunk.usage.completion_tokens if chunk.usage else got
    return kind, first if first is not None else time.perf_counter() - t0, got


@dataclass(frozen=True)
class StreamSpec:
    """One stream of a phase, as its client process runs it (`load_stream`)."""

    s: int
    """The stream's number: its requests are s, s + streams, s + 2 streams, ..."""
    phase: int
    deadline: float
    """On `clients.now`'s clock."""
    streams: int
    max_tokens: int
    short_share: float


def load_stream(client, model: str, spec: StreamSpec, docs: list[str]) -> dict:
    """A stream's requests one after another until the deadline, long ones over the documents in
    turn (each stream and phase from its own place among them); what came back, by kind, and the
    errors (an error answer or a failed connection: counted, the stream goes on)."""
    rng = random.Random(spec.s)
    ttft: dict[str, list[float]] = {"long": [], "short": []}
    tokens, errors, k, j = 0, Counter(), spec.s, 0
    while now() < spec.deadline:
        doc = None
        if rng.random() >= spec.short_share:
            doc = docs[(spec.phase * spec.streams + spec.s + j * spec.streams) % len(docs)]
            j += 1
        try:
            kind, first, got = one_request(client, model, doc, k, spec.max_tokens)
        except Exception as e:
            errors[type(e).__name__] += 1
        else:
            ttft[kind].append(first)
            tokens += got
        k += spec.streams
    return {"ttft": ttft, "tokens": tokens, "errors": errors}


class Load:
    """Streams, in client processes of their own (`bench/clients.py`), that each send requests
    until a deadline; what came back, by kind."""

    def __init__(self, users: Users, args):
        self.users, self.args = users, args
        self.ttft: dict[str, list[float]] = {"long": [], "short": []}
        self.tokens = 0
        self.errors: Counter = Counter()
        self.phases = 0

    def phase(self) -> dict:
        a = self.args
        t0 = now()
        specs = [StreamSpec(s, self.phases, t0 + a.seconds, a.streams, a.max_tokens, a.short_share)
                 for s in range(a.streams)]  # fmt: skip
        got = self.users.map(load_stream, specs)
        wall = now() - t0
        self.phases += 1
        for g in got:
            for kind, xs in g["ttft"].items():
                self.ttft[kind] += xs
            self.tokens += g["tokens"]
            self.errors.update(g["errors"])
        return {
            "wall_s": wall,
            "answered": sum(len(xs) for g in got for xs in g["ttft"].values()),
            "tokens": sum(g["tokens"] for g in got),
            "errors": sum(sum(g["errors"].values()) for g in got),
        }


def percentile(xs: list[float], q: float) -> float | None:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else None)


def run(args, docs: list[str], progress) -> tuple[list[dict], dict]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        server = ServerProcess(args, store, inspect=False)
        users = Users(
            server.url, server.model, args.client_processes or default_processes(args.streams), docs
        )
        load = Load(users, args)
        rows = []
        task = progress.add_task("phases", total=args.phases)
        try:
            for p in range(1, args.phases + 1):
                figures = load.phase()
                m = server.settle(args.settle_s)
                state = {k: m[k] for k in (*KEPT, *IDLE, *CAPACITY, *SETTLED, "pool_slots_shared")}
                rows.append({"phase": p, **figures, **state, **store_usage(store)})
                progress.console.print(f"phase {p}: " + ", ".join(f"{k} {v:g}" for k, v in rows[-1].items()
                                       if isinstance(v, (int, float))))  # fmt: skip
                progress.advance(task)
        finally:
            users.close()
            err = server.stop()
        if server.proc.returncode != 0:
            raise SystemExit(f"kvflash serve exited {server.proc.returncode}: {err[-2000:]}")
    latency = {
        kind: {"n": len(xs), "p50_s": percentile(xs, 50), "p99_s": percentile(xs, 99)}
        for kind, xs in load.ttft.items()
    }
    warned = [line for line in err.splitlines() if "Warning" in line]
    return rows, {"ttft": latency, "errors": dict(load.errors), "server_warnings": warned}


def verdict(rows: list[dict], summary: dict) -> dict[str, bool]:
    return {
        "no errors": not summary["errors"],
        "nothing in flight, staged or leased": all(not any(r[k] for k in (*SETTLED, "leases")) for r in rows),
        "every slot in use held by an idle sequence": all(
            r[used] == r[idle] for r in rows for used, idle in zip(KEPT[:2], IDLE, strict=True)
        ),
        "slots in use within capacity": all(
            r["pool_slots_used"] <= r["pool_slots"] and r["host_tier_slots_used"] <= r["host_tier_slots"]
            for r in rows
        ),
    }


def report(args, rows: list[dict], summary: dict, checks: dict[str, bool]) -> None:
    console = Console()
    t = Table(title=f"{args.streams} streams x {args.seconds:g} s, {args.short_share:.0%} short chats")
    for col in ("phase", "answered", "req/s", "tok/s", "errors", *KEPT, "leases"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["phase"]), str(r["answered"]), f"{r['answered'] / r['wall_s']:.1f}",
                  f"{r['tokens'] / r['wall_s']:.0f}", str(r["errors"]), *(f"{r[k]:g}" for k in KEPT),
                  str(r["leases"]))  # fmt: skip
    console.print(t)
    for kind, v in summary["ttft"].items():
        if v["n"]:
            console.print(
                f"{kind}: {v['n']} answered, first text p50 {v['p50_s']:.2f} s, p99 {v['p99_s']:.2f} s"
            )
    warned = summary["server_warnings"]
    console.print(f"the server warned {len(warned)} times" + "".join(f"\n  {w}" for w in warned[:5]))
    for name, ok in checks.items():
        console.print(f"{'met' if ok else 'MISSED'}: {name}")


def plot(rows: list[dict], summary: dict, path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    kinds = [k for k, v in summary["ttft"].items() if v["n"]]
    xs = range(len(kinds))
    a.bar([x - 0.2 for x in xs], [summary["ttft"][k]["p50_s"] for k in kinds], 0.4, label="p50")
    a.bar([x + 0.2 for x in xs], [summary["ttft"][k]["p99_s"] for k in kinds], 0.4, label="p99")
    a.set_xticks(list(xs), kinds)
    a.set_ylabel("seconds to first text")
    a.legend()
    for k in KEPT:
        b.plot([r["phase"] for r in rows], [r[k] for r in rows], marker="o", label=k)
    b.set_xticks([r["phase"] for r in rows])
    b.set_xlabel("after phase")
    b.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    ap.add_argument("--phases", type=int, default=2)
    ap.add_argument("--long-tokens", dest="doc_tokens", type=int, default=8192)
    ap.add_argument("--documents", type=int, default=256, help="distinct long documents, cycled")
    ap.add_argument("--short-share", type=float, default=0.5, help="share of requests that are short chats")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--pool-tokens", default="auto")
    ap.add_argument("--host-bytes", type=int, default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes the streams run in (default: one per two streams, up to half the cores)",
    )
    ap.add_argument("--settle-s", type=float, default=2.0, help="idle seconds before a phase's row")
    ap.add_argument("--out", default="out/serve_load")
    args = ap.parse_args()
    args.tracemalloc = args.arena_max = None  # ServerProcess's memory-report options, unused here
    out = out_dir(args.out)
    with progress_bar() as progress:
        docs = documents(args)
        rows, summary = run(args, docs, progress)
    checks = verdict(rows, summary)
    report(args, rows, summary, checks)
    write_json(out / "serve_load.json", {"meta": run_meta(args=vars(args)), "rows": rows, **summary,
                                          "checks": checks})  # fmt: skip
    plot(rows, summary, out / "serve_load.png")
    print(f"wrote {out / 'serve_load.json'} and {out / 'serve_load.png'}")


if __name__ == "__main__":
    main()
