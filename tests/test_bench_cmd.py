"""`kvflash bench` end to end on the real default model (CPU), and its bad flags."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvflash import KVFlashError
from kvflash.cli.app import app


def test_bench_asks_cold_then_restores_from_disk(smollm_path, tmp_path) -> None:
    """A 1,024-token document over a 512-token pool: turn 1 prefills it all, turn 2 (a fresh engine
    and session) restores it lazily from the snapshot turn 1 wrote, prefills only the question, and
    still reads the passcode; the JSON on stdout is the bench.json written beside the plot."""
    out = tmp_path / "out"
    args = ["bench", "--lengths", "1024", "--pool-tokens", "512", "--out", str(out),
            "--model", str(smollm_path), "--device", "cpu", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report == json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (row,) = report["rows"]
    cold, warm = row["cold"], row["restored"]
    assert row["doc_tokens"] == 1024 and cold["prefilled_tokens"] > 1024
    assert cold["source"] == "cold" and cold["restored_tokens"] == 0 and cold["snapshot_id"]
    assert warm["source"] == "lazy" and warm["restored_tokens"] >= 1024 - 64
    assert warm["prefilled_tokens"] < cold["prefilled_tokens"] - warm["restored_tokens"] + 64
    assert warm["bytes_moved"]["disk"] > 0
    assert cold["found"] and warm["found"]
    assert row["ttft_ratio"] == warm["ttft_s"] / cold["ttft_s"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lengths", "2K,big"], "--lengths"),
        (["--lengths", "0"], "positive"),
        (["--pool-tokens", "0"], "--pool-tokens must be positive"),
        (["--pool-tokens", "lots"], "--pool-tokens takes"),
    ],
)
def test_bench_bad_flags_fail_before_loading_a_model(tmp_path, args: list[str], message: str) -> None:
    flags = ["--out", str(tmp_path / "o"), "--model", "/nowhere.gguf"]
    result = CliRunner().invoke(app, ["bench", *args, *flags])
    assert isinstance(result.exception, KVFlashError) and re.search(message, str(result.exception))
