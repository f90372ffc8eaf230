"""A conversation over HTTP: `kvflash serve` against the same server with `--no-store`, side by side.
Without a store the server reuses only the live sequence of the last request, as a GPU-only prefix
cache does, and loses it when it restarts.

Each arm runs its own `kvflash serve` process on 127.0.0.1 and has a conversation about one document
through the `openai` client, streaming: --turns questions, each request sending the whole
conversation so far, as OpenAI clients do. Then the server is restarted and the last turn is asked
again, so the kvflash arm must restore from disk. TTFT is measured by the client (request sent to the
first content delta). Prints a table and writes JSON and a PNG. Many conversations at once are
bench/serve_batch.py's.

  python -m bench.serve --doc-tokens 4096 --turns 3 --out out/serve
"""

from __future__ import annotations

import argparse
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import openai
from rich.console import Console
from rich.table import Table

from bench.harness import (
    free_port,
    make_document,
    out_dir,
    progress_bar,
    pyplot,
    save_png,
    spawn_server,
    wait_until_serving,
    write_json,
)

QUESTIONS = [
    "What is the first sentence of the document about?",
    "Who is mentioned most often in the document?",
    "Summarise the document in one sentence.",
    "Which place comes up last?",
    "What would you ask the author?",
]


class Served:
    """`kvflash serve` in a child process, up until stopped."""

    def __init__(self, args, store: Path | None, max_batch: int = 1, shared: str | None = None):
        self.port = free_port()
        cmd = [sys.executable, "-m", "kvflash.cli.app", "serve", "--port", str(self.port),
               "--pool-tokens", str(args.pool_tokens), "--max-batch", str(max_batch)]  # fmt: skip
        cmd += ["--store", str(store)] if store else [] if shared else ["--no-store"]
        cmd += ["--shared-store", shared] if shared else []
        if getattr(args, "max_prompt_tokens", None):
            cmd += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
        if getattr(args, "step_tokens", None):
            cmd += ["--step-tokens", str(args.step_tokens)]
        if getattr(args, "store_processes", None) is not None:
            cmd += ["--store-processes", str(args.store_processes)]
        if args.model:
            cmd += ["--model", args.model]
        if args.device:
            cmd += ["--device", args.device]
        self.proc = spawn_server(cmd)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until_serving(self.proc, self.url)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=3600)
        self.model = self.client.models.list().data[0].id

    def turn(self, messages: list[dict], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        stream = self.client.chat.completions.create(
            model=self.model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - t0
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        return {
            "ttft_s": ttft or time.perf_counter() - t0,
            "total_s": time.perf_counter() - t0,
            "text": text,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "completion_tokens": usage.completion_tokens,
        }

    def stop(self, timeout_s: float = 120) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout_s)


def conversation(args, doc: str, store: Path | None, progress, task) -> list[dict]:
    """--turns turns on one server, then the last again on a restarted one."""
    messages = [{"role": "system", "content": doc}]
    rows = []
    server = Served(args, store)
    try:
        for i in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            r = server.turn(messages, args.max_tokens)
            rows.append({"turn": i + 1, "restart": False, **r})
            messages.append({"role": "assistant", "content": r["text"]})
            progress.advance(task)
    finally:
        server.stop()
    server = Served(args, store)
    try:
        rows.append({"turn": args.turns, "restart": True, **server.turn(messages[:-1], args.max_tokens)})
        progress.advance(task)
    finally:
        server.stop()
    return rows


def prepare(args) -> tuple[Path, str]:
    """The output directory (made) and a document of --doc-tokens tokens by the model's tokenizer."""
    from kvflash.models.loader import load_model

    out = out_dir(args.out)
    tok = load_model(args.model, device="cpu").tokenizer
    return out, make_document(args.doc_tokens, lambda s: len(tok.encode_plain(s)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pool-tokens", type=int, default=16384)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="out/serve")
    args = ap.parse_args()
    out, doc = prepare(args)
    arms = {}
    with tempfile.TemporaryDirectory() as tmp, progress_bar() as progress:
        for arm, store in (("kvflash", Path(tmp) / "store"), ("no-store", None)):
            task = progress.add_task(arm, total=args.turns + 1)
            arms[arm] = conversation(args, doc, store, progress, task)
    table = Table(title=f"conversation over HTTP, {args.doc_tokens:,}-token document: client TTFT (s)")
    for col in ("turn", "kvflash", "cached tokens", "no-store", "kvflash / no-store", "same answer"):
        table.add_column(col, justify="right")
    for ours, peer in zip(arms["kvflash"], arms["no-store"], strict=True):
        name = f"{ours['turn']}" + (" (restarted)" if ours["restart"] else "")
        ratio, same = ours["ttft_s"] / peer["ttft_s"], ours["text"] == peer["text"]
        table.add_row(name, f"{ours['ttft_s']:.2f}", str(ours["cached_tokens"]), f"{peer['ttft_s']:.2f}",
                      f"{ratio:.3f}", str(same))  # fmt: skip
    Console().print(table)
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "args": vars(args)}
    body = {"meta": meta, "arms": arms}
    write_json(out / "serve.json", body)
    plot(arms, out / "serve.png")


def plot(arms: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()

    rows = arms["kvflash"]
    labels = [f"turn {r['turn']}" + ("\nrestarted" if r["restart"] else "") for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for shift, (arm, rs) in zip((-0.2, 0.2), arms.items(), strict=True):
        ax.bar([i + shift for i in x], [r["ttft_s"] for r in rs], 0.4, label=arm)
    ax.set_xticks(list(x), labels)
    ax.set_yscale("log")
    ax.set_ylabel("client TTFT (s)")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
