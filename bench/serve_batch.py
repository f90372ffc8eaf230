"""Many conversations on one server at once, against HF transformers' batched `generate`.

For each count N of --conversations: N clients (the official `openai` client, streaming, on
127.0.0.1, from client processes of their own: bench/clients.py), each with its own document of
--doc-tokens tokens (windows of the reference document at different offsets, so no two share a
prefix), ask turn 1 together on a server with its own store;
then each resends its conversation with one more question (turn 2, whose document KV the server
holds live or on disk) and all decode --decode-tokens tokens together. The same runs on a server at
`--max-batch 1` (one request at a time: the sum of the prefills alone, and the throughput batching
must beat). Then N conversations over one shared document of --shared-tokens tokens ask at once:
the prompt tokens the server computed (from /metrics) against one document plus the questions, and
the pool slots in use at the peak (from /metrics) against N times the document's.

The peer is HF transformers on the same GPU, batched `generate` over the same turn-1 prompts (left
padded, SDPA, whole KV on the GPU): a prefill alone, --max-tokens and --decode-tokens new tokens, so
its decode rate is (decode-tokens - 1) * N over the difference. Answers are of fixed length on both
sides (`min_tokens` on the server, `min_new_tokens` for HF). Turn 2's table shows the TTFT the
clients saw beside the server's own (from a request reaching its scheduler to its first token): the
difference is HTTP, the clients and the prompt's tokenisation. `--no-store` runs servers that save
nothing, to show what the snapshot writes cost the turns beside them. `--servers K` runs the batched
arm on K servers one after another: a machine's first server has been slower in its turns than the
ones after it (docs/BENCHMARKS.md), which one run then shows beside the others.

  python -m bench.serve_batch --conversations 1,8,32 --doc-tokens 8192 --out out/serve_batch
  python -m bench.serve_batch --conversations 8,32 --shared-only --out out/serve_batch_shared
  python -m bench.serve_batch --conversations 32 --servers 2 --no-hf --out out/serve_batch_servers
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from bench.clients import Ask, Users, default_processes, now
from bench.document import reference_text
from bench.harness import out_dir, progress_bar, pyplot, save_png, write_json
from bench.serve import QUESTIONS, Served
from kvflash.models.loader import load_model
from kvflash.serve.prompt import encode_messages


def together(users: Users, asks: list[Ask]) -> tuple[dict, list[str]]:
    """Every conversation's next turn at once: wall, TTFT, and the decode rate while all stream;
    `server_window` is the turn on the server's epoch clock (the first arrival, the last finish), by
    which a profile's samples (bench/stacks) are picked out."""
    t0 = now()
    streams = users.stream(asks)
    wall = now() - t0
    window = (min(s.server_arrival for s in streams), max(s.server_finished for s in streams))
    ttfts = sorted(s.ttft for s in streams)
    lo, hi = max(s.times[0] for s in streams), min(s.times[-1] for s in streams)
    inside = sum(lo < t <= hi for s in streams for t in s.times)
    row = {
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": ttfts[-1],
        "server_ttft_p50_s": statistics.median(s.server_ttft_s for s in streams),
        "tokens": sum(s.completion_tokens for s in streams),
        "tok_s": sum(s.completion_tokens for s in streams) / wall,
        "decode_tok_s": inside / (hi - lo) if hi - lo > 0.05 else None,
        "cached_tokens": sum(s.cached_tokens for s in streams),
        "prompt_tokens": sum(s.prompt_tokens for s in streams),
        "server_prefill_sum_s": sum(s.server_prefill_s for s in streams),
        "server_span_s": window[1] - window[0],
        "server_window": window,
    }
    return row, [s.text for s in streams]


def metric(server: Served, name: str) -> int:
    """A sample of the server's /metrics (0 where it has none yet)."""
    return int(samples(server, name)[0])


def samples(server: Served, *names: str) -> tuple[float, ...]:
    """Samples of one scrape of the server's /metrics (0 where it has none yet)."""
    text = httpx.get(f"{server.url}/metrics").text
    found = (re.search(rf"^kvflash_{re.escape(name)} (\S+)$", text, re.M) for name in names)
    return tuple(float(m.group(1)) if m else 0.0 for m in found)


STEP_KINDS = ("decode", "mixed", "prefill")
"""The scheduler's steps by kind: decode tokens alone, decode tokens and prefill pieces, pieces alone."""


def step_times(server: Served) -> dict[str, tuple[float, ...]]:
    """Per step kind: (steps, their seconds, of those the scheduler's wait for the device) so far."""
    names = [f'step{what}{{kind="{kind}"}}' for kind in STEP_KINDS
             for what in ("_seconds_count", "_seconds_sum", "_wait_seconds_sum")]  # fmt: skip
    got = samples(server, *names)
    return {kind: got[3 * i : 3 * i + 3] for i, kind in enumerate(STEP_KINDS)}


def step_figures(before: dict[str, tuple[float, ...]], after: dict[str, tuple[float, ...]]) -> dict:
    """A turn's steps of each kind: how many, the mean step in ms and the share of it spent waiting
    for the device (the rest is the host's: a host-bound server waits little)."""
    row = {}
    for kind in STEP_KINDS:
        n, secs, wait = (a - b for a, b in zip(after[kind], before[kind], strict=True))
        row |= {f"{kind}_step_count": int(n), f"{kind}_step_ms": 1e3 * secs / n if n else None,
                f"{kind}_wait_share": wait / secs if secs else None}  # fmt: skip
    return row


USE_METRICS = {
    "device_mallocs": "device_mallocs_total",
    "device_alloc_retries": "device_alloc_retries_total",
    "kernel_variants_built": "kernel_variants_built_total",
    "host_tier_grown_bytes": "host_tier_bytes_allocated",
}
"""A turn's figures read from the server's /metrics (0 where it has none, as on the CPU), by the
series they are the difference of: device allocations, allocations retried after the allocator
freed its cache, kernel variants built (each a compile, or a load from Triton's cache, in the middle
of the turn) and the host tier's memory (pinned on CUDA: its pages touched and registered)."""


def process_use(server: Served) -> dict[str, float]:
    """The server process's user and system CPU seconds and minor page faults so far, all threads
    (Linux's /proc/PID/stat): a turn that faults in memory the machine never used before (a
    virtual machine's memory is backed on first touch) spends it as system time; then USE_METRICS."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    use = {"server_user_s": int(fields[11]) / tick, "server_system_s": int(fields[12]) / tick,
           "server_minor_faults": int(fields[7])}  # fmt: skip
    return use | dict(zip(USE_METRICS, samples(server, *USE_METRICS.values()), strict=True))


def use_figures(before: dict[str, float], after: dict[str, float]) -> dict:
    """A turn's share of what `process_use` counts: seconds as they are, counts and bytes whole."""
    return {k: after[k] - before[k] if k.endswith("_s") else int(after[k] - before[k]) for k in after}


def prefill_steps(server: Served, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """(forwards that ran prefill pieces, pieces they ran) since `since`: a turn's pieces over its
    steps is how many prompts shared a forward (all N in one step where they arrived together)."""
    steps, pieces = samples(server, "prefill_steps_total", "prefill_pieces_total")
    return int(steps) - since[0], int(pieces) - since[1]


def computed_tokens(server: Served) -> int:
    """Prompt tokens the server has prefilled (not reused)."""
    return metric(server, 'tokens_total{kind="cold"}')


WARM = Ask([{"role": "user", "content": "Hello."}], 2)
"""The request each client process sends before anything is timed (`Users.warm`)."""


def conversations(args, docs: list[str], max_batch: int) -> dict:
    """Turn 1 of every conversation together, then turn 2 of every one together, on a server with a
    store of its own: a conversation whose sequence is no longer live (freed for room) restores its
    turn 2 from disk instead of prefilling it again. `max_batch` bounds the requests that run
    together, not the sequences kept live between turns."""
    store = tempfile.TemporaryDirectory()
    server = Served(args, None if args.no_store else Path(store.name) / "store", max_batch)
    convs = [
        [{"role": "system", "content": d}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        for i, d in enumerate(docs)
    ]
    try:
        with Users(server.url, server.model, args.client_processes or default_processes(len(docs))) as users:
            users.warm(WARM)
            before, steps, use = prefill_steps(server), step_times(server), process_use(server)
            turn1, answers = together(users, [Ask(c, args.max_tokens) for c in convs])
            turn1 |= use_figures(use, process_use(server))
            turn1["prefill_steps"], turn1["prefill_pieces"] = prefill_steps(server, before)
            turn1 |= step_figures(steps, step_times(server))
            for i, (c, a) in enumerate(zip(convs, answers, strict=True)):
                nxt = QUESTIONS[(i + 1) % len(QUESTIONS)]
                c += [{"role": "assistant", "content": a}, {"role": "user", "content": nxt}]
            before, steps, use = prefill_steps(server), step_times(server), process_use(server)
            turn2, _ = together(users, [Ask(c, args.decode_tokens) for c in convs])
            turn2 |= use_figures(use, process_use(server))
            turn2["prefill_steps"], turn2["prefill_pieces"] = prefill_steps(server, before)
            turn2 |= step_figures(steps, step_times(server))
    finally:
        server.stop()
        store.cleanup()
    return {"max_batch": max_batch, "turn1": turn1, "turn2": turn2}


def shared(args, doc: str, n: int) -> dict:
    """n conversations over one document at once: what the server prefilled of it, the prompt
    tokens it shared from the pool, and the pool slots in use at the peak (each client process's warm-up
    request holds one), against n times the document's chunks."""
    server = Served(args, None, n)
    try:
        with Users(server.url, server.model, args.client_processes or default_processes(n)) as users:
            users.warm(WARM)
            before, gpu_before = computed_tokens(server), metric(server, 'tokens_total{kind="gpu"}')
            asks = [Ask([{"role": "system", "content": doc}, {"role": "user", "content": QUESTIONS[i % 5]}],
                        args.max_tokens) for i in range(n)]  # fmt: skip
            row, _ = together(users, asks)
        row["computed_tokens"] = computed_tokens(server) - before
        row["gpu_shared_tokens"] = metric(server, 'tokens_total{kind="gpu"}') - gpu_before
        row["pool_slots_peak"] = metric(server, "pool_slots_used_peak")
        row["pool_slots_shared"] = metric(server, "pool_slots_shared")
        chunk = metric(server, "pool_tokens_used") // max(1, metric(server, "pool_slots_used"))
        row["doc_slots"] = -(-args.shared_tokens // chunk)
    finally:
        server.stop()
    return row


def hf_batched(lm, model, prompts: list[list[int]], tokens: int) -> float:
    """Seconds of one batched greedy `generate` of exactly `tokens` new tokens per prompt."""
    width = max(map(len, prompts))
    pad = lm.tokenizer.eos_ids and min(lm.tokenizer.eos_ids) or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=lm.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=lm.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                       do_sample=False, pad_token_id=pad)  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_arm(args, lm, model, docs: list[str]) -> dict:
    prompts = [
        encode_messages(lm.tokenizer, [{"role": "system", "content": d},
                                       {"role": "user", "content": QUESTIONS[i % 5]}])
        for i, d in enumerate(docs)
    ]  # fmt: skip
    try:
        hf_batched(lm, model, prompts[:1], 2)  # warm
        prefill = hf_batched(lm, model, prompts, 1)
        e2e = hf_batched(lm, model, prompts, args.max_tokens)
        long = hf_batched(lm, model, prompts, args.decode_tokens)
    except torch.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"error": f"out of memory: {e}"[:200]}
    decode = len(prompts) * (args.decode_tokens - 1) / (long - prefill)
    return {"prefill_s": prefill, "e2e_s": e2e, "e2e_long_s": long, "decode_tok_s": decode}


def documents(args, lm, n: int) -> tuple[list[str], str]:
    """n windows of --doc-tokens tokens of the reference at n offsets, and --shared-tokens of it."""
    length = max(args.shared_tokens, 2 * args.doc_tokens, 131072)
    ids = lm.tokenizer.encode_plain(reference_text(length, lm.tokenizer))
    stride = max(1, (len(ids) - args.doc_tokens) // max(1, n - 1))
    docs = [lm.tokenizer.decode(ids[i * stride : i * stride + args.doc_tokens]) for i in range(n)]
    return docs, lm.tokenizer.decode(ids[: args.shared_tokens])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", default="1,8,32", help="comma-separated counts")
    ap.add_argument("--doc-tokens", type=int, default=8192)
    ap.add_argument("--shared-tokens", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=32, help="answer length of turn 1")
    ap.add_argument("--decode-tokens", type=int, default=128, help="answer length of turn 2")
    ap.add_argument("--pool-tokens", default="auto")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--step-tokens", type=int, default=None, help="the servers' --step-tokens")
    ap.add_argument(
        "--store-processes", type=int, default=None, help="the servers' --store-processes (default: theirs)"
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes the clients stream from (default: one per two conversations, up to half the cores)",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument(
        "--no-store",
        action="store_true",
        help="servers without a store: what saving the answers' snapshots costs the turns beside it",
    )
    ap.add_argument("--shared-only", action="store_true", help="only the conversations over one document")
    ap.add_argument(
        "--servers",
        type=int,
        default=1,
        help="run the batched arm on this many servers one after another (a machine's first server is "
        "slower than the ones after it: docs/BENCHMARKS.md)",
    )
    ap.add_argument("--out", default="out/serve_batch")
    args = ap.parse_args()
    counts = [int(n) for n in args.conversations.split(",")]
    out = out_dir(args.out)
    lm = load_model(args.model, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    docs, shared_doc = documents(args, lm, max(counts))
    rows = []
    with progress_bar() as progress:
        per_count = 1 if args.shared_only else 2 + max(1, args.servers)
        task = progress.add_task("conversations", total=len(counts) * per_count)
        for n in counts:
            row = {"n": n}
            if not args.shared_only:
                row["batched"] = guarded(conversations, args, docs[:n], n)
                progress.advance(task)
                row["batched_later"] = []
                for _ in range(args.servers - 1):
                    row["batched_later"].append(guarded(conversations, args, docs[:n], n))
                    progress.advance(task)
                row["one_at_a_time"] = guarded(conversations, args, docs[:n], 1) if n > 1 else row["batched"]
                progress.advance(task)
            row["shared"] = guarded(shared, args, shared_doc, n)
            progress.advance(task)
            rows.append(row)
    hf = {}
    if not (args.no_hf or args.shared_only) and lm.device.type == "cuda":
        from bench.hf import hf_llama

        model = hf_llama(lm)
        hf = {n: guarded(hf_arm, args, lm, model, docs[:n]) for n in counts}
        del model
    for r in rows:
        r["hf"] = hf.get(r["n"], {})
    report(args, rows)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": gpu, "args": vars(args)}  # fmt: skip
    write_json(out / "serve_batch.json", {"meta": meta, "rows": rows}, default=asdict)
    if not args.shared_only:
        plot(rows, out / "serve_batch.png")


def guarded(fn, *args) -> dict:
    """fn(*args), or the error it raised: one failed arm leaves the others' figures."""
    try:
        return fn(*args)
    except Exception as e:
        Console().print(f"[red]{fn.__name__} failed: {type(e).__name__}: {e}"[:400])
        return {"error": f"{type(e).__name__}: {e}"[:400]}


def _part(r: dict, arm: str, turn: str | None = None) -> dict:
    got = r.get(arm, {})
    return got.get(turn, {}) if turn else got


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def step_cell(turn: dict, kind: str = "decode") -> str:
    ms, share = turn.get(f"{kind}_step_ms"), turn.get(f"{kind}_wait_share")
    return "-" if ms is None else f"{ms:.2f} ({share:.0%})"


def use_cell(turn: dict) -> str:
    if "server_user_s" not in turn:
        return "-"
    return f"{turn['server_user_s']:.2f} / {turn['server_system_s']:.2f} ({turn['server_minor_faults']:,})"


def report(args, rows: list[dict]) -> None:
    if not args.shared_only:
        report_conversations(args, rows)
        if args.servers > 1:
            report_servers(rows)
    report_shared(args, rows)


def report_servers(rows: list[dict]) -> None:
    """The batched arm on successive servers: what a machine's first server costs its turns, in
    which of turn 1's steps (their mean, and the share of it the scheduler waited for the device),
    and the server's CPU seconds (user / system) and minor page faults in each turn."""
    t = Table(title="the batched arm on successive servers")
    for col in ("N", "server", "turn 1 wall s", "turn 1 span at the server s",
                "turn 1 TTFT p50 at the server", "turn 1 mixed step ms", "turn 1 prefill step ms",
                "turn 1 CPU s user / system (faults)", "turn 2 TTFT p50", "at the server",
                "turn 2 decode tok/s", "turn 2 CPU s"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        for i, arm in enumerate([r.get("batched", {}), *r.get("batched_later", [])], 1):
            a, b = arm.get("turn1", {}), arm.get("turn2", {})
            t.add_row(str(r["n"]), str(i), _f(a.get("wall_s")), _f(a.get("server_span_s")),
                      _f(a.get("server_ttft_p50_s")),
                      step_cell(a, "mixed"), step_cell(a, "prefill"), use_cell(a),
                      _f(b.get("ttft_p50_s")), _f(b.get("server_ttft_p50_s")),
                      _f(b.get("decode_tok_s"), ".0f"), use_cell(b))  # fmt: skip
    Console().print(t)


def report_conversations(args, rows: list[dict]) -> None:
    doc = f"{args.doc_tokens:,}-token documents"
    t = Table(title=f"turn 1: N conversations, {doc}, {args.max_tokens} tokens each")
    for col in ("N", "wall s", "TTFT p50", "TTFT max", "wall, one at a time", "prefills alone s",
                "wall / prefills alone", "span at the server s", "span / prefills alone", "HF e2e s",
                "HF prefill s"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        b, one, hf = _part(r, "batched", "turn1"), _part(r, "one_at_a_time", "turn1"), r["hf"]
        alone = one.get("server_prefill_sum_s")
        t.add_row(str(r["n"]), _f(b.get("wall_s")), _f(b.get("ttft_p50_s")), _f(b.get("ttft_max_s")),
                  _f(one.get("wall_s")), _f(alone), _f(_ratio(b.get("wall_s"), alone)),
                  _f(b.get("server_span_s")), _f(_ratio(b.get("server_span_s"), alone)),
                  _f(hf.get("e2e_s")), _f(hf.get("prefill_s")))  # fmt: skip
    Console().print(t)
    t = Table(title=f"turn 2: the same conversations, one more question, {args.decode_tokens} tokens each")
    for col in ("N", "wall s", "TTFT p50", "at the server", "prefill steps / pieces", "tok/s",
                "tok/s one at a time", "x", "decode tok/s (all N)", "decode step ms (device wait)",
                "HF decode tok/s", "x HF"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        b, one, hf = _part(r, "batched", "turn2"), _part(r, "one_at_a_time", "turn2"), r["hf"]
        peer, ours = hf.get("decode_tok_s"), b.get("decode_tok_s")
        x_hf = ours / peer if ours and peer else None
        x_one = b["tok_s"] / one["tok_s"] if b and one else None
        steps = f"{b['prefill_steps']} / {b['prefill_pieces']}" if "prefill_steps" in b else "-"
        t.add_row(str(r["n"]), _f(b.get("wall_s")), _f(b.get("ttft_p50_s")), _f(b.get("server_ttft_p50_s")),
                  steps, _f(b.get("tok_s"), ".0f"),
                  _f(one.get("tok_s"), ".0f"), _f(x_one), _f(ours, ".0f"), step_cell(b), _f(peer, ".0f"),
                  _f(x_hf, ".1f"))  # fmt: skip
    Console().print(t)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def report_shared(args, rows: list[dict]) -> None:
    t = Table(title=f"N conversations over one {args.shared_tokens:,}-token document, at once")
    for col in ("N", "wall s", "TTFT p50", "prompt tokens", "computed", "computed / (doc + questions)",
                "shared from the pool", "pool slots at peak", "N x document slots"):  # fmt: skip
        t.add_column(col, justify="right")
    for r in rows:
        s = _part(r, "shared")
        if "error" in s:
            t.add_row(str(r["n"]), s["error"][:60])
            continue
        once = args.shared_tokens + s["prompt_tokens"] - r["n"] * args.shared_tokens
        t.add_row(str(r["n"]), _f(s["wall_s"]), _f(s["ttft_p50_s"]), str(s["prompt_tokens"]),
                  str(s["computed_tokens"]), _f(s["computed_tokens"] / once), str(s["gpu_shared_tokens"]),
                  str(s["pool_slots_peak"]), str(r["n"] * s["doc_slots"]))  # fmt: skip
    Console().print(t)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    ns = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(ns, [_part(r, "batched", "turn1").get("wall_s") for r in rows], "o-", label="kvflash, batched")
    one = [_part(r, "one_at_a_time", "turn1").get("wall_s") for r in rows]
    a.plot(ns, one, "o--", label="kvflash, --max-batch 1")
    a.plot(ns, [r["hf"].get("e2e_s") for r in rows], "s-", label="HF batched generate")
    a.set(xlabel="conversations", ylabel="turn 1 wall (s)", xscale="log", yscale="log")
    ours = [_part(r, "batched", "turn2").get("decode_tok_s") for r in rows]
    b.plot(ns, ours, "o-", label="kvflash, batched")
    b.plot(ns, [r["hf"].get("decode_tok_s") for r in rows], "s-", label="HF batched generate")
    b.set(xlabel="conversations", ylabel="decode tok/s (all streaming)", xscale="log", yscale="log")
    for ax in (a, b):
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
