"""Bad input to the real `kvflash` command: each gets one clean error line and a non-zero status,
never a traceback or a hang; user text (labels, session names) is printed, never read as markup."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from kvflash.cli.app import main
from kvflash.storage import SnapshotStore
from tests.store_util import FP, make_chain, toks


def kvflash(argv: list[str], capfd, monkeypatch) -> tuple[int, str, str]:
    """Runs `kvflash argv` in this process through the console script's entry point."""
    monkeypatch.setattr(sys, "argv", ["kvflash", *argv])
    with pytest.raises(SystemExit) as e:
        main()
    out, err = capfd.readouterr()
    return e.value.code, out, err


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code not in (0, None), err
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture
def doc(tmp_path) -> Path:
    p = tmp_path / "doc.txt"
    p.write_text("The harbour light was built in 1871 by Ada Morrow.")
    return p


def bad_documents(tmp_path: Path) -> dict[str, tuple[str, str]]:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    return {
        "symlink loop": (str(loop), "symbolic links"),
        "name too long": (str(tmp_path / ("a" * 5000)), "too long"),
        "/dev/zero": ("/dev/zero", "not a regular file"),
        "fifo": (str(fifo), "not a regular file"),
        "directory": (str(tmp_path), "not a regular file"),
        "missing": (str(tmp_path / "nope.txt"), "not found"),
        "not utf-8": (str(latin), "UTF-8"),
    }


def test_bad_documents_give_one_line(tmp_path, capfd, monkeypatch) -> None:
    for name, (path, message) in bad_documents(tmp_path).items():
        code, _, err = kvflash(["ask", path, "q?", "--no-store"], capfd, monkeypatch)
        assert message in one_error_line(code, err), name


def test_bad_flags_give_one_line(tmp_path, capfd, monkeypatch, doc) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with SnapshotStore(tmp_path / "store", workers=2) as st:
        st.put_snapshot("s", FP, make_chain(toks(1)))
    cases = {
        "device tpu": (["generate", "hi", "--device", "tpu"], "--device"),
        "seed 2**64": (["generate", "hi", "--seed", str(2**64)], "--seed"),
        "seed -1": (["generate", "hi", "--seed", "-1"], "--seed"),
        "top-p 0": (["generate", "hi", "--top-p", "0"], "--top-p"),
        "top-p 2": (["generate", "hi", "--top-p", "2"], "--top-p"),
        "max-bytes 400 digits": (
            ["snapshot", "prune", "--max-bytes", "9" * 400, "--store", str(tmp_path / "store")],
            "size",
        ),
        "max-bytes 30 digits": (
            ["snapshot", "prune", "--max-bytes", "9" * 30, "--store", str(tmp_path / "store")],
            "above",
        ),
        "older-than 400 digits": (
            ["snapshot", "prune", "--older-than", "9" * 400 + "d", "--store", str(tmp_path / "store")],
            "age",
        ),
        "store at a file": (["snapshot", "list", "--store", str(a_file)], "no snapshot store"),
        "store under a file": (["snapshot", "du", "--store", str(a_file / "sub")], "no snapshot store"),
        "pool-tokens text": (["ask", str(doc), "q?", "--pool-tokens", "lots", "--no-store"], "--pool-tokens"),
        "unknown command": (["snapshot", "frobnicate"], "frobnicate"),
        "pin not a span": (["ask", str(doc), "q?", "--pin", "middle", "--no-store"], "--pin"),
        "pin end before start": (["ask", str(doc), "q?", "--pin", "9:3", "--no-store"], "--pin"),
        "pin with --server": (
            ["ask", str(doc), "q?", "--pin", "system", "--server", "http://127.0.0.1:9"],
            "--pin",
        ),
        "serve max-waiting 0": (["serve", "--no-store", "--max-waiting", "0"], "--max-waiting"),
        "kv-dtype with --server": (
            ["ask", str(doc), "q?", "--kv-dtype", "bf16", "--server", "http://127.0.0.1:9"],
            "--kv-dtype",
        ),
    }
    for command in (["ask", str(doc), "q?"], ["chat", str(doc)], ["serve"], ["niah"], ["bench"]):
        cases[f"{command[0]} kv-dtype fp4"] = ([*command, "--kv-dtype", "fp4"], "--kv-dtype")
    if not torch.cuda.is_available():
        cases["device cuda without CUDA"] = (["generate", "hi", "--device", "cuda"], "no CUDA device")
    for name, (argv, message) in cases.items():
        code, _, err = kvflash(argv, capfd, monkeypatch)
        assert message in one_error_line(code, err), name


def test_a_pool_larger_than_memory_is_refused_before_allocating(
    smollm_path, doc, tmp_path, capfd, monkeypatch
) -> None:
    """Every command that takes --pool-tokens checks it against free memory once the model is loaded,
    with one message, before it allocates anything that size."""
    commands = {
        "ask": ["ask", str(doc), "q?", "--no-store"],
        "serve": ["serve", "--no-store", "--port", "1"],
        "bench": ["bench", "--lengths", "1K", "--out", str(tmp_path / "bench")],
        "niah": ["niah", "--policy", "qk", "--lengths", "1K", "--out", str(tmp_path / "niah")],
    }
    for name, argv in commands.items():
        flags = ["--pool-tokens", "1000000000", "--model", str(smollm_path), "--device", "cpu"]
        code, _, err = kvflash([*argv, *flags], capfd, monkeypatch)
        line = one_error_line(code, err)
        assert "--pool-tokens 1000000000: the pool needs" in line and "GiB free" in line, name


def test_files_that_are_no_regular_text_and_sizes_past_memory_are_one_line(
    smollm_path, tmp_path, capfd, monkeypatch
) -> None:
    """A haystack that is a FIFO (an open that never returns) or /dev/zero (a read that never ends)
    is refused as a document is; `generate -n` past memory is refused before its pool is allocated."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    model = ["--model", str(smollm_path), "--device", "cpu"]
    for haystack in (fifo, Path("/dev/zero")):
        argv = ["niah", "--lengths", "1K", "--haystack", str(haystack), "--out", str(tmp_path / "n"), *model]
        code, _, err = kvflash(argv, capfd, monkeypatch)
        assert "not a regular file" in one_error_line(code, err), haystack
    code, _, err = kvflash(["generate", "hi", "-n", str(10**11), *model], capfd, monkeypatch)
    assert "--max-tokens 100000000000: the pool needs" in one_error_line(code, err)


def test_ask_answers_without_a_store_it_cannot_open(smollm_path, doc, tmp_path, capfd, monkeypatch) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for store in (a_file, a_file / "under"):
        argv = ["ask", str(doc), "Who built it?", "-n", "4", "--json", "--store", str(store)]
        code, out, err = kvflash([*argv, "--model", str(smollm_path), "--device", "cpu"], capfd, monkeypatch)
        assert code == 0 and "Traceback" not in err
        assert json.loads(out)["generated_tokens"] >= 1
        assert "warning: snapshot store unusable" in err


def test_user_text_is_never_markup(smollm_path, doc, tmp_path, capfd, monkeypatch) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        st.put_snapshot("[/]x[bold]", FP, make_chain(toks(1)))
    monkeypatch.setenv("COLUMNS", "250")  # the table's label column unwrapped
    code, out, err = kvflash(["snapshot", "list", "--store", str(root)], capfd, monkeypatch)
    assert code == 0 and "[/]x[bold]" in out, err
    argv = ["ask", str(doc), "Who?", "-n", "3", "--json", "--store", str(root), "--session", "[/]\tz"]
    code, out, err = kvflash([*argv, "--model", str(smollm_path), "--device", "cpu"], capfd, monkeypatch)
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["generated_tokens"] >= 1
    assert "[/]" in err  # the warning that the label cannot be saved names it literally
