"""Merges NIAH arms (each a `kvflash niah` output directory) into one markdown table.

Accuracy per length and overall, the gap to the full-attention cold arm in points, mean TTFT per
length, and for restore arms the share of answers identical to the cold arm with the same settings
(restore must answer exactly as cold).

    python -m bench.niah_table out/niah/*/summary.json > table.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvflash.eval.niah_report import fmt_length

ANSWER_FIELDS = ("mode", "out", "lengths", "depths", "trials")
"""Settings that may differ between a restore arm and the cold arm it must reproduce."""


def load(summary_path: Path) -> dict:
    summary = json.loads(summary_path.read_text())
    rows = [json.loads(x) for x in (summary_path.parent / "results.jsonl").read_text().splitlines()]
    summary["answers"] = {(r["length"], r["depth"], r["trial"]): r["answer"] for r in rows}
    return summary


def same_settings(a: dict, b: dict) -> bool:
    strip = {k: v for k, v in a["config"].items() if k not in ANSWER_FIELDS}
    return strip == {k: v for k, v in b["config"].items() if k not in ANSWER_FIELDS}


def equal_to_cold(arm: dict, arms: list[dict]) -> str:
    if arm["config"]["mode"] == "cold":
        return ""
    cold = next((a for a in arms if a["config"]["mode"] == "cold" and same_settings(a, arm)), None)
    if cold is None:
        return "no cold arm"
    shared = [k for k in arm["answers"] if k in cold["answers"]]
    same = sum(arm["answers"][k] == cold["answers"][k] for k in shared)
    return f"{same}/{len(shared)}"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(arms: list[dict]) -> str:
    lengths = list(dict.fromkeys(n for a in arms for n in a["by_length"]))
    full = next((a for a in arms if a["config"]["policy"] == "full" and a["config"]["mode"] == "cold"), None)
    head = ["arm", *map(fmt_length, lengths), "all", "trials", "vs full (pts)"]
    head += [f"TTFT {fmt_length(n)} (s)" for n in lengths] + ["answers = cold"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in arms:
        gap = "" if full is None or a is full else f"{100 * (a['overall'] - full['overall']):+.1f}"
        ttft = a.get("mean_ttft_s_by_length", {})
        cells = [
            a["arm"],
            *(pct(a["by_length"].get(n)) for n in lengths),
            pct(a["overall"]),
            str(a["n"]),
            gap,
        ]
        cells += [f"{ttft[n]:.2f}" if n in ttft else "–" for n in lengths] + [equal_to_cold(a, arms)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summaries", nargs="+", type=Path, help="summary.json of each arm, in table order")
    args = p.parse_args()
    print(table([load(s) for s in args.summaries]))


if __name__ == "__main__":
    main()
