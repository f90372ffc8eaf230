"""`kvflash ask --server`: client processes against a real `kvflash serve` on 127.0.0.1 (the default
model on the CPU), checked to import no torch and to send one request a turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_server import free_port, serve_process

DOC = (
    "Harbor notes. The lighthouse of Port Elden was built by Mara Quill in 1843 and painted red in "
    "1901. The Copper Oven bakery on Tide Street is famous for its rye bread, baked before dawn."
)
CLIENT = """
import json, sys, urllib.request
sent, urlopen = [], urllib.request.urlopen
urllib.request.urlopen = lambda req, **kw: sent.append(req.full_url) or urlopen(req, **kw)
from kvflash.cli.app import main
try:
    main()
finally:
    heavy = sorted({"torch", "numpy", "rich"} & sys.modules.keys())
    print(json.dumps({"imported": heavy, "requests": sent}), file=sys.stderr)
"""
"""Runs the CLI, then reports on the last line of stderr which heavy modules it imported and the URLs
it sent requests to."""


@pytest.fixture(scope="module")
def server(smollm_path, tmp_path_factory):
    with serve_process(smollm_path, tmp_path_factory.mktemp("store"), "--max-tokens", "8") as (url, proc):
        yield url
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def client(*args: str, home: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """One `kvflash` client process; its stderr ends with CLIENT's report."""
    environ = {k: v for k, v in os.environ.items() if k != "KVFLASH_SERVER"}
    environ.update(KVFLASH_HOME=str(home), **(env or {}))
    cmd = [sys.executable, "-c", CLIENT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)


def report(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stderr.strip().splitlines()[-1])


def test_a_named_session_across_two_client_processes_reuses_the_servers_kv(server, tmp_path) -> None:
    doc, home = tmp_path / "harbor.txt", tmp_path / "home"
    doc.write_text(DOC)
    question = "Who built the lighthouse?"
    models, chat = f"{server}/v1/models", f"{server}/v1/chat/completions"
    first = client("ask", str(doc), question, "--session", "s", "--server", server, "--json", home=home)
    assert first.returncode == 0, first.stderr
    assert report(first) == {"imported": [], "requests": [models, chat]}
    turn1 = json.loads(first.stdout)
    assert turn1["answer"] and turn1["restored_tokens"] == 0 and turn1["source"] == "cold"

    second = client("ask", str(doc), "And the bakery?", "-s", "s", home=home, env={"KVFLASH_SERVER": server})
    assert second.returncode == 0, second.stderr
    assert report(second) == {"imported": [], "requests": [chat]}  # the model id, remembered
    *answer, stats = second.stdout.strip().splitlines()
    assert "".join(answer).strip(), second.stdout
    assert "(memory)" in stats  # the stats line, from the response's kvflash field
    restored = int(stats.split("restored ")[1].split(" tok")[0])
    assert restored >= turn1["prefilled_tokens"]  # turn 1's prompt came from the server's live KV

    (saved,) = (home / "client-sessions").glob("*.json")
    turns = json.loads(saved.read_text())["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant"] * 2
    assert turns[0]["content"] == question and turns[1]["content"] == turn1["answer"]


def test_an_unreachable_server_or_an_error_answer_is_one_line_and_a_failure(server, tmp_path) -> None:
    doc = tmp_path / "d.txt"
    doc.write_text(DOC)
    down = client("ask", str(doc), "q", "--server", f"http://127.0.0.1:{free_port()}", home=tmp_path)
    wrong = client("ask", str(doc), "q", "--server", f"{server}/not-an-api", home=tmp_path)
    local = client("ask", str(doc), "q", "--server", server, "--pool-tokens", "64", home=tmp_path)
    for proc, words in ((down, "cannot reach"), (wrong, "answered 404"), (local, "--pool-tokens")):
        error, _ = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and error.startswith("error:") and words in error, proc.stderr
        assert "torch" not in report(proc)["imported"] and proc.stdout == ""
    assert not (tmp_path / "client-sessions").exists()


def test_a_model_the_server_no_longer_serves_is_replaced_by_the_one_it_lists(server, tmp_path) -> None:
    doc, models = tmp_path / "d.txt", tmp_path / "client-models.json"
    doc.write_text(DOC)
    models.write_text(json.dumps({server: "a-model-served-before", "http://elsewhere": "other"}))
    proc = client("ask", str(doc), "Who built the lighthouse?", "--server", server, "--json", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    chat = f"{server}/v1/chat/completions"
    assert report(proc)["requests"] == [chat, f"{server}/v1/models", chat]
    assert json.loads(proc.stdout)["answer"]
    served = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    assert json.loads(models.read_text()) == {server: served, "http://elsewhere": "other"}
