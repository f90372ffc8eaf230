"""A NIAH grid's results as people read them: the summary (accuracy by length and depth, mean
TTFT), its table and its heatmap."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from kvflash.eval.niah import NiahConfig


def cell_key(length: int, depth: float, trial: int) -> tuple[int, float, int]:
    return int(length), round(float(depth), 4), int(trial)


def _acc(rows: list[dict]) -> float | None:
    return sum(r["hit"] for r in rows) / len(rows) if rows else None


def summarize(cfg: NiahConfig, rows: list[dict]) -> dict:
    """Accuracy by cell, length, depth and overall over the rows of this config's grid."""
    wanted = {cell_key(n, d, 0)[:2] for n in cfg.lengths for d in cfg.depths}
    rows = [r for r in rows if cell_key(r["length"], r["depth"], 0)[:2] in wanted and r["trial"] < cfg.trials]
    by_len = {n: [r for r in rows if r["length"] == n] for n in cfg.lengths}
    by_depth = {round(d, 4): [r for r in rows if r["depth"] == round(d, 4)] for d in cfg.depths}
    cells = []
    for n in cfg.lengths:
        for d in by_depth:
            c = [r for r in by_len[n] if r["depth"] == d]
            cells.append(
                {"length": n, "depth": d, "n": len(c), "hits": sum(r["hit"] for r in c), "accuracy": _acc(c)}
            )
    ttft = {str(n): round(sum(r["ttft_s"] for r in rs) / len(rs), 3) for n, rs in by_len.items() if rs}
    return {
        "arm": cfg.label,
        "overall": _acc(rows),
        "n": len(rows),
        "by_length": {str(n): _acc(rs) for n, rs in by_len.items()},
        "by_depth": {f"{d:g}": _acc(rs) for d, rs in by_depth.items()},
        "cells": cells,
        "mean_ttft_s_by_length": ttft,
        "config": cfg.to_dict(),
    }


def fmt_length(n: int | str) -> str:
    """A token count as a label: 131072 -> "128K"; counts that are not whole K as they are."""
    return f"{int(n) // 1024}K" if int(n) % 1024 == 0 else str(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def table(summary: dict) -> Table:
    """Depth rows × length columns, with an `all` row and column."""
    lengths = [int(n) for n in summary["by_length"]]
    t = Table(title=summary["arm"], caption=f"{_pct(summary['overall'])} of {summary['n']} trials")
    t.add_column("depth", justify="right")
    for n in lengths:
        t.add_column(fmt_length(n), justify="right")
    t.add_column("all", justify="right", style="bold")
    acc = {(c["length"], c["depth"]): c["accuracy"] for c in summary["cells"]}
    for d, a in summary["by_depth"].items():
        t.add_row(d, *(_pct(acc.get((n, round(float(d), 4)))) for n in lengths), _pct(a))
    t.add_row(
        "all", *(_pct(a) for a in summary["by_length"].values()), _pct(summary["overall"]), style="bold"
    )
    return t


def heatmap(summary: dict, path: Path) -> None:
    """Depth (rows, top = start of the document) × length (columns), annotated, colour scale 0..1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = [int(n) for n in summary["by_length"]]
    depths = [float(d) for d in summary["by_depth"]]
    acc = {(c["length"], c["depth"]): c for c in summary["cells"]}
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            c = acc.get((n, round(d, 4)))
            if c and c["accuracy"] is not None:
                grid[i, j] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(2.0 + 1.3 * len(lengths), 1.6 + 0.42 * len(depths)), dpi=120)
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#dddddd")
    im = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            c = acc.get((n, round(d, 4)))
            text = f"{c['hits']}/{c['n']}" if c and c["n"] else "-"
            dark = c and c["n"] and not 0.2 <= c["accuracy"] <= 0.85  # the deep red and green ends
            ax.text(j, i, text, ha="center", va="center", fontsize=10, color="white" if dark else "black")
    ax.set_xticks(range(len(lengths)), [fmt_length(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"NIAH: {summary['arm']}\noverall {_pct(summary['overall'])} of {summary['n']} trials")
    fig.colorbar(im, ax=ax, label="accuracy", fraction=0.08)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
