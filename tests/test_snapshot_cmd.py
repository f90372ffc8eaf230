"""The `kvflash snapshot` commands over a real store, in process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvflash import KVFlashError
from kvflash.cli import snapshot_cmd
from kvflash.storage import (
    SnapshotStore,
)
from tests.store_util import (
    FP,
    chunk_path,
    flip,
    make_chain,
    toks,
)

# CLI


CLI = (
    "import typer; from kvflash.cli import snapshot_cmd as s; "
    "a = typer.Typer(); a.add_typer(s.app, name='snapshot'); a()"
)


def test_sizes_and_ages() -> None:
    assert snapshot_cmd.parse_size("10G") == 10 << 30
    assert snapshot_cmd.parse_size("500M") == 500 << 20
    assert snapshot_cmd.parse_size("1.5GiB") == 3 << 29
    assert snapshot_cmd.parse_size("4096") == 4096
    assert snapshot_cmd.parse_age("7d") == 7 * 86400 and snapshot_cmd.parse_age("12h") == 12 * 3600
    for bad in ("10X", "-1G", "", "1e9"):
        with pytest.raises(KVFlashError):
            snapshot_cmd.parse_size(bad)
    with pytest.raises(KVFlashError):
        snapshot_cmd.parse_age("7 days")


def test_cli_via_subprocess(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        good = st.put_snapshot("good", FP, make_chain(toks(2)))
        blobs = make_chain(toks(2, start=500))
        bad = st.put_snapshot("bad", FP, blobs)
    flip(chunk_path(root, blobs[1].chain_hash), -3)
    runs = {"list": ["list"], "verify": ["verify", bad]}  # concurrent: each start imports torch
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-c", CLI, "snapshot", *args, "--store", str(root), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, args in runs.items()
    }
    out = {k: (p.communicate(timeout=60), p.returncode) for k, p in procs.items()}
    (listing, _), rc = out["list"]
    assert rc == 0 and {s["id"] for s in json.loads(listing)} == {good, bad}
    (verify, _), rc = out["verify"]
    assert rc == 1
    report = json.loads(verify)
    assert not report["ok"] and report["damaged"][0]["chunk_hash"] == blobs[1].chain_hash


def test_cli_commands(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        a = st.put_snapshot("a", FP, make_chain(toks(2)))
        b = st.put_snapshot("b", FP, make_chain(toks(3)))
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> dict | list:
        r = runner.invoke(snapshot_cmd.app, [*args, "--store", str(root), "--json"])
        assert r.exit_code == code, (args, r.output, r.exception)
        return json.loads(r.stdout) if code == 0 else {}

    facts = run("inspect", b)
    assert facts["n_chunks"] == 3 and facts["header"]["codec"] == "lossless_bf16"  # bf16 KV
    assert [c["refcount"] for c in facts["chunks"]] == [2, 2, 1]
    plan = run("prune", "--max-bytes", "10G", "--older-than", "7d", "--dry-run")
    assert plan["dry_run"] and plan["snapshots"] == []
    assert run("pin", a) == {"id": a, "pinned": True}
    assert run("verify", "--all")["ok"]
    assert run("prune", "--max-bytes", "0")["snapshots"] == [b]
    assert run("unpin", a)["pinned"] is False
    assert run("du")["snapshots"] == 1
    assert run("rm", a)["snapshots"] == [a]
    assert run("list") == []
    for bad in (["inspect", "../x"], ["verify"], ["rm", "0123456789ab"]):
        r = runner.invoke(snapshot_cmd.app, [*bad, "--store", str(root)])
        assert r.exit_code != 0
    r = runner.invoke(snapshot_cmd.app, ["list", "--store", str(tmp_path / "typo")])
    assert "no snapshot store" in str(r.exception)
    for human in (["list"], ["du"], ["verify", "--all"]):
        assert runner.invoke(snapshot_cmd.app, [*human, "--store", str(root)]).exit_code == 0


def test_inspect_decodes_text_with_a_given_tokenizer(store) -> None:
    sid = store.put_snapshot("s", FP, make_chain(toks(2)))
    facts = snapshot_cmd.inspect_snapshot(store, sid, decode_tokens=lambda ids: " ".join(map(str, ids)))
    assert facts["text"] == " ".join(map(str, toks(2)))
