"""Wall time of a whole `kvflash ask --server` process for turn 2 of a long-document session.

Starts `kvflash serve` on 127.0.0.1 (the default model unless --model) and writes a generated
document of about --tokens tokens. Then, --repeats times, turn 1 of a named session goes through
`kvflash ask --server` (the first a cold prefill on the server, later ones reuse it) and a new
`kvflash ask --server` process asks turn 2 of that session (the document's KV live on the server),
timed from process start to exit. Prints each wall time with the turn's stats line; writes JSON.

Each turn 2 is split into the client's own time and the server's: the client runs under CLIENT, which
marks when the chat request is sent, when its first text arrives and when the answer ends. Its own
time is the rest: interpreter start, imports and arguments, the document and session read (before
the request), then the session saved, the stats line printed and the interpreter's exit (after).

  python -m bench.ask_server --tokens 131072 --out out/ask_server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.harness import free_port, out_dir, write_json
from kvflash.eval.haystack import filler_sentences
from kvflash.models.fetch import default_model_path
from kvflash.models.loader import load_model

QUESTION_1 = "Summarise the document in one sentence."
QUESTION_2 = "Name one person the document mentions."
CLIENT = """
import time
marks = {"started": time.monotonic()}
import json, sys
from kvflash.serve import client
from kvflash.cli.app import main
chat = client.Server.chat
def timed_chat(self, messages, max_tokens, on_text):
    def on_first(piece):
        marks.setdefault("first_text", time.monotonic())
        on_text(piece)
    marks["request"] = time.monotonic()
    reply = chat(self, messages, max_tokens, on_first)
    marks["done"], marks["stats"] = time.monotonic(), reply.stats
    return reply
client.Server.chat = timed_chat
try:
    main()
finally:
    print(json.dumps(marks), file=sys.stderr)
"""
"""`kvflash` with `Server.chat` timed; its last line on stderr is the marks, in seconds of the
monotonic clock, which the processes of one host share."""


def write_document(path: Path, tokens: int, model: Path) -> int:
    """Filler sentences up to about `tokens` tokens of the model's tokenizer; returns the exact count."""
    tok = load_model(model, device="cpu").tokenizer
    sentences, lines, n = filler_sentences(random.Random(0)), [], 0
    while n < tokens:
        line = " ".join(next(sentences) for _ in range(20)) + "\n"
        n += len(tok.encode_plain(line))
        lines.append(line)
    path.write_text("".join(lines))
    return len(tok.encode_plain(path.read_text()))


def wait_up(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"kvflash serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit("kvflash serve did not come up") from None
            time.sleep(0.5)


def ask(url: str, doc: Path, question: str, session: str, home: Path, max_tokens: int) -> tuple[dict, str]:
    """One `kvflash ask --server` process: (its times in seconds, its stats line)."""
    cmd = [sys.executable, "-c", CLIENT, "ask", str(doc), question, "--server", url,
           "--session", session, "-n", str(max_tokens)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "KVFLASH_HOME": str(home)})
    end = time.monotonic()
    if proc.returncode != 0:
        raise SystemExit(f"kvflash ask failed: {proc.stderr.strip()}")
    marks = json.loads(proc.stderr.strip().splitlines()[-1])
    return split(t0, marks, end), proc.stdout.strip().splitlines()[-1]


def split(t0: float, marks: dict, end: float) -> dict:
    """A client process's wall time, from its spawn at t0 to its exit at end, in parts (CLIENT's)."""
    first = marks.get("first_text", marks["done"])  # an answer of no text
    start, before, after = marks["started"] - t0, marks["request"] - marks["started"], end - marks["done"]
    return {
        "wall_s": end - t0, "client_s": start + before + after, "interpreter_s": start,
        "before_request_s": before, "to_first_text_s": first - marks["request"],
        "server_ttft_s": marks["stats"]["ttft_s"], "rest_of_answer_s": marks["done"] - first,
        "after_answer_s": after,
    }  # fmt: skip


def client_line(t: dict) -> str:
    return (
        f"client {t['client_s']:.3f} s (interpreter start {t['interpreter_s']:.3f}, then to the request "
        f"{t['before_request_s']:.3f}, after the answer {t['after_answer_s']:.3f}) | request to first "
        f"text {t['to_first_text_s']:.3f} s (server TTFT {t['server_ttft_s']:.3f}), rest of the answer "
        f"{t['rest_of_answer_s']:.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072, help="document length in tokens")
    ap.add_argument("--model", default=None, help="GGUF (default: the pulled default model)")
    ap.add_argument("--pool-tokens", default="auto", help="the server's --pool-tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="out/ask_server")
    args = ap.parse_args()
    model = Path(args.model) if args.model else default_model_path(fetch=True)
    out = out_dir(args.out)
    with tempfile.TemporaryDirectory(prefix="kvflash-ask-server-") as tmp:
        tmp = Path(tmp)
        doc, home = tmp / "document.txt", tmp / "home"
        n = write_document(doc, args.tokens, model)
        print(f"document: {n:,} tokens")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve = [sys.executable, "-m", "kvflash.cli.app", "serve", "--model", str(model), "--port", str(port),
                 "--pool-tokens", args.pool_tokens, "--store", str(tmp / "store")]  # fmt: skip
        server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_up(url, server, 600)
            turns2, wall1 = [], None
            for i in range(args.repeats):  # turn 2 right after its own turn 1, as a user asks them
                t1, line1 = ask(url, doc, QUESTION_1, f"bench-{i}", home, args.max_tokens)
                wall1 = t1["wall_s"] if wall1 is None else wall1
                print(f"turn 1, session {i + 1}: {t1['wall_s']:.2f} s  {line1}")
                t2, line = ask(url, doc, QUESTION_2, f"bench-{i}", home, args.max_tokens)
                turns2.append(t2)
                print(f"turn 2, session {i + 1}: {t2['wall_s']:.2f} s  {line}\n  {client_line(t2)}")
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(120)
        walls = [t["wall_s"] for t in turns2]
        median, client = statistics.median(walls), statistics.median(t["client_s"] for t in turns2)
        result = {
            "tokens": n, "turn1_wall_s": wall1, "turn2_wall_s": walls, "turn2_median_s": median,
            "turn2_client_median_s": client, "turn2_times": turns2, "turn2_stats": line,
            "date": time.strftime("%Y-%m-%d"), "args": vars(args),
        }  # fmt: skip
        write_json(out / "ask_server.json", result)
        print(f"turn 2 wall, median of {len(walls)}: {median:.2f} s, the client's own {client:.3f} s; "
              f"wrote {out / 'ask_server.json'}")  # fmt: skip


if __name__ == "__main__":
    main()
