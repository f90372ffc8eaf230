"""`kvflash snapshot list` reads at 80 columns: no cell cut, no line wider than the terminal."""

from __future__ import annotations

from test_storage import FP, make_chain, toks
from typer.testing import CliRunner

from kvflash.cli import snapshot_cmd
from kvflash.storage import SnapshotStore

LABELS = ("ask:0123456789abcdef", "serve:fedcba9876543210", "session:harbor-notes")


def test_the_default_listing_fits_80_columns_and_wide_shows_every_fact(tmp_path) -> None:
    root = tmp_path / "store"
    with SnapshotStore(root, workers=2) as st:
        ids = [st.put_snapshot(label, FP, make_chain(toks(n + 1))) for n, label in enumerate(LABELS)]
        st.pin(ids[0])
    runner = CliRunner()
    listing = runner.invoke(snapshot_cmd.app, ["list", "--store", str(root)], env={"COLUMNS": "80"})
    assert listing.exit_code == 0, listing.output
    lines = listing.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in listing.stdout, listing.stdout
    for sid, label in zip(ids, LABELS, strict=True):
        (row,) = [line for line in lines if sid in line]
        assert label in row
    assert f"{ids[0]}*" in listing.stdout and "* pinned" in listing.stdout
    wide = runner.invoke(snapshot_cmd.app, ["list", "--wide", "--store", str(root)], env={"COLUMNS": "200"})
    assert wide.exit_code == 0 and all(c in wide.stdout for c in ("chunks", "ratio", "created", "pinned"))
