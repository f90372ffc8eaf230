"""The NIAH harness: seeded needles, haystack length and depth, resume, arm checks and outputs.

Fast tests run the grid on a stand-in answerer (a word-and-punctuation token count, and a "model"
that finds the needle only near the start of the document); one slow test runs SmolLM2.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from kvflash import KVFlashError
from kvflash.cli.niah_cmd import parse_depths, parse_lengths
from kvflash.eval.haystack import PASSCODE, RULER, needle_value
from kvflash.eval.niah import Answer, Grid, NiahConfig, make_haystack, run_grid, trial_seed
from kvflash.serve.session import TurnStats


def count_tokens(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


class HalfBlind:
    """Answers with the first long number in the first 40% of the document, else a wrong guess."""

    def __init__(self) -> None:
        self.calls = 0
        self.pinned: list[str] = []

    def count_tokens(self, text: str) -> int:
        return count_tokens(text)

    def answer(self, length: int, document: str, question: str, pin: tuple[int, int] | None = None) -> Answer:
        self.calls += 1
        if pin:
            self.pinned.append(document[pin[0] : pin[1]])
        found = re.findall(r"\d{5,}", document[: len(document) * 2 // 5])
        text = f"The passcode is {found[0]}." if found else "The passcode is 12345."
        return Answer(text, TurnStats(ttft_s=0.01), pool_tokens=448, prompt_tokens=length + 40)


def small(tmp_path: Path, **over) -> NiahConfig:
    base = dict(lengths=(512, 1024), depths=(0.0, 0.5, 1.0), trials=2, out=str(tmp_path / "arm"))
    return NiahConfig(**{**base, **over})


def test_each_cell_and_trial_gets_its_own_reproducible_needle() -> None:
    cfg = NiahConfig()
    keys = [(n, d, t) for n in cfg.lengths for d in cfg.depths for t in range(cfg.trials)]
    seeds = {trial_seed(0, *k) for k in keys}
    assert len(seeds) == len(keys) == 132
    assert trial_seed(1, 2048, 0.5, 0) != trial_seed(0, 2048, 0.5, 0)
    values = [
        make_haystack(256, d, trial_seed(0, 256, d, t), count_tokens, PASSCODE).value for _, d, t in keys[:44]
    ]
    assert len(set(values)) == len(values)
    again = make_haystack(256, 0.3, trial_seed(0, 256, 0.3, 1), count_tokens, RULER)
    assert again == make_haystack(256, 0.3, trial_seed(0, 256, 0.3, 1), count_tokens, RULER)


def test_needle_values_avoid_easy_guesses() -> None:
    rng = random.Random(3)
    for v in (needle_value(rng) for _ in range(2000)):
        assert 5 <= len(v) <= 7 and v[0] != "0"
        assert not any(a == b for a, b in zip(v, v[1:], strict=False)), v
        steps = [int(b) - int(a) for a, b in zip(v, v[1:], strict=False)]
        assert not any(s in (1, -1) and s == t for s, t in zip(steps, steps[1:], strict=False)), v


@pytest.mark.parametrize("length", [512, 2048])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_haystack_hits_length_and_depth(length: int, depth: float) -> None:
    hay = make_haystack(length, depth, trial_seed(0, length, depth, 0), count_tokens, PASSCODE)
    total = count_tokens(hay.document)
    assert abs(total - length) <= 0.03 * length
    at = hay.document.index(PASSCODE.needle.format(value=hay.value))
    assert abs(count_tokens(hay.document[:at]) / total - depth) < 0.05
    assert hay.value in hay.document and "passcode" in hay.question


def test_haystack_file_is_repeated_to_length_and_must_have_sentences() -> None:
    text = "The tide came in early. Gulls argued over the nets. A bell rang twice in the fog."
    hay = make_haystack(1024, 0.5, 7, count_tokens, RULER, filler_text=text)
    assert abs(count_tokens(hay.document) - 1024) <= 0.03 * 1024
    with pytest.raises(KVFlashError, match="sentences"):
        make_haystack(1024, 0.5, 7, count_tokens, RULER, filler_text="word " * 3000)


def test_resume_skips_finished_trials_and_redoes_a_torn_row(tmp_path) -> None:
    arm = HalfBlind()
    first = run_grid(Grid(small(tmp_path)), arm)
    assert arm.calls == 12 and first["n"] == 12
    run_grid(Grid(small(tmp_path)), arm)
    assert arm.calls == 12
    results = tmp_path / "arm" / "results.jsonl"
    not_rows = '[1, 2]\n{"length": 512}\n'
    results.write_text(results.read_text() + not_rows + '{"length": 512, "dep')  # and a crash mid-row
    summary = run_grid(Grid(small(tmp_path, trials=3)), arm)
    assert arm.calls == 12 + 6 and summary["n"] == 18
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len({(r["length"], r["depth"], r["trial"]) for r in rows}) == len(rows) == 18


def test_another_arm_in_the_same_directory_is_refused(tmp_path) -> None:
    Grid(small(tmp_path, policy="qk", budget_frac=0.25))
    Grid(small(tmp_path, policy="qk", budget_frac=0.25, lengths=(1024,), trials=5))  # grid may change
    with pytest.raises(KVFlashError, match=r"another arm \(budget_frac 0.25 -> 0.125\)"):
        Grid(small(tmp_path, policy="qk", budget_frac=0.125))
    with pytest.raises(KVFlashError, match="mode"):
        Grid(small(tmp_path, policy="qk", budget_frac=0.25, mode="restore"))
    with pytest.raises(KVFlashError, match=r"cache_order 'document' -> 'score'"):
        Grid(small(tmp_path, policy="qk", budget_frac=0.25, cache_order="score"))
    with pytest.raises(KVFlashError, match=r"scout_reads 0 -> 8"):
        Grid(small(tmp_path, policy="qk", budget_frac=0.25, scout_reads=8))
    saved = tmp_path / "arm" / "config.json"
    kept = saved.read_text()
    saved.write_text("[1, 2]")
    with pytest.raises(KVFlashError, match="not a grid's readable JSON"):
        Grid(small(tmp_path, policy="qk", budget_frac=0.25))
    saved.write_text(kept)
    old = json.loads(saved.read_text())
    del old["cache_order"], old["scout_reads"]  # saved before the fields existed: their defaults
    saved.write_text(json.dumps(old))
    Grid(small(tmp_path, policy="qk", budget_frac=0.25))


def test_summary_and_heatmap(tmp_path) -> None:
    summary = run_grid(Grid(small(tmp_path, trials=1)), HalfBlind())
    assert summary["by_depth"] == {"0": 1.0, "0.5": 0.0, "1": 0.0}
    assert summary["by_length"] == {"512": pytest.approx(1 / 3), "1024": pytest.approx(1 / 3)}
    assert summary["arm"] == "full, cold" and summary["config"]["trials"] == 1
    assert json.loads((tmp_path / "arm" / "summary.json").read_text()) == summary
    png = tmp_path / "arm" / "heatmap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    h, w, _ = matplotlib.image.imread(png).shape
    assert 300 < w < 1200 and 300 < h < 1200


def test_pool_sizes() -> None:
    qk = NiahConfig(policy="qk", budget_frac=1 / 8)
    assert qk.pool_for(8192, 8300) == 1024
    assert qk.pool_for(2048, 2100) == 7 * 64  # 1/8 of 2K is under the floor of 7 chunks
    assert NiahConfig().pool_for(2048, 2100) == 2176  # full: prompt + answer, whole chunks
    assert NiahConfig(policy="sink", pool_tokens=700).pool_for(2048, 2100) == 700
    assert qk.label == "qk @ 1/8 of length, cold"
    assert NiahConfig(policy="qk", budget_frac=1 / 8, cache_order="score").label == (
        "qk @ 1/8 of length, cold, score order"
    )
    lazy = NiahConfig(policy="qk", pool_tokens=4096, mode="lazy", scout_reads=16)
    assert lazy.label == "qk @ 4096 tok, lazy, 16 scout reads"
    assert lazy.engine_config().residency.scout_reads == 16


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(policy="full", pool_tokens=1024), "drop --pool-tokens"),
        (dict(policy="qk"), "exactly one of --pool-tokens or --budget-frac"),
        (dict(policy="qk", pool_tokens=100), "below the floor"),
        (dict(policy="lru", budget_frac=1.5), "budget-frac"),
        (dict(mode="warm"), "unknown mode"),
        (dict(codec="zip"), "unknown codec"),
        (dict(cache_order="random"), "unknown cache order"),
        (dict(needle="no value here"), r"\{value\}"),
        (dict(question="What about {name}?"), "bad needle or question template"),
        (dict(depths=(0.5, 2.0)), "depths"),
    ],
)
def test_bad_settings_are_refused(over: dict, message: str) -> None:
    with pytest.raises(KVFlashError, match=message):
        NiahConfig(**over)


def test_cli_parsers() -> None:
    assert parse_lengths("2048, 4K,8k") == (2048, 4096, 8192)
    assert parse_lengths("2K,2048,4K") == (2048, 4096) and parse_depths("0.5,0,0.5") == (0.5, 0.0)
    assert parse_depths("5") == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert len(parse_depths("11")) == 11 and parse_depths("0.5") == (0.5,)
    for bad in ("2K,x", "4.5K"):
        with pytest.raises(KVFlashError, match="--lengths"):
            parse_lengths(bad)
    for bad in ("1", "0,a"):
        with pytest.raises(KVFlashError, match="--depths"):
            parse_depths(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "full", "--budget-frac", "0.5"], "drop --pool-tokens"),
        (["--policy", "sink"], "--pool-tokens or --budget-frac"),
        (["--lengths", "2K,big"], "--lengths"),
        (["--haystack", "/nowhere/hay.txt"], "haystack file not found"),
    ],
)
def test_cli_bad_flags_fail_before_loading_a_model(tmp_path, args: list[str], message: str) -> None:
    import typer
    from typer.testing import CliRunner

    from kvflash.cli.niah_cmd import niah

    app = typer.Typer()
    app.command()(niah)
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out"), "--model", "/nowhere.gguf"])
    assert isinstance(result.exception, KVFlashError) and re.search(message, str(result.exception))


@pytest.mark.slow
def test_smollm_small_grid_restore_answers_as_cold(smollm_path, tmp_path) -> None:
    from kvflash.eval.niah import run
    from kvflash.models.loader import load_model

    lm = load_model(smollm_path, dtype="fp32", device="cpu")
    arm = dict(lengths=(1024,), depths=(0.0, 0.5, 1.0), trials=1, policy="qk", budget_frac=0.5)
    cold = run(NiahConfig(**arm, out=str(tmp_path / "cold")), lm)
    restore = run(NiahConfig(**arm, mode="restore", out=str(tmp_path / "restore")), lm)

    def rows(name: str) -> list[dict]:
        return [json.loads(x) for x in (tmp_path / name / "results.jsonl").read_text().splitlines()]

    c, r = rows("cold"), rows("restore")
    assert [x["answer"] for x in r] == [x["answer"] for x in c]
    assert [x["value"] for x in r] == [x["value"] for x in c]
    assert all(x["source"] == "cold" and x["restored_tokens"] == 0 for x in c)
    assert all(x["source"] == "disk" and x["restored_tokens"] >= 960 for x in r)
    assert all(abs(x["doc_tokens"] - 1024) <= 31 and x["pool_tokens"] == 512 for x in c + r)
    assert all(x["resident_chunks"] <= 8 for x in c + r)
    assert cold["overall"] == restore["overall"] and cold["overall"] >= 1 / 3
    assert (tmp_path / "restore" / "heatmap.png").stat().st_size > 10_000


@pytest.mark.slow
def test_smollm_qk_at_an_eighth_finds_needles_far_from_the_question(smollm_path, tmp_path) -> None:
    """A 2K document, a pool of 1/8 (raised to the 7-chunk floor, 448 tokens), needles at depths
    0.1-0.4: at absolute positions qk finds none at these depths on the 2K-8K grid (0/48); with
    positions within the cache, scored where they would sit, 46/48 (docs/BENCHMARKS.md: NIAH).
    Here: at least three of four."""
    from kvflash.eval.niah import run
    from kvflash.models.loader import load_model

    lm = load_model(smollm_path, dtype="fp32", device="cpu")
    arm = dict(lengths=(2048,), depths=(0.1, 0.2, 0.3, 0.4), trials=1, policy="qk", budget_frac=0.125)
    summary = run(NiahConfig(**arm, out=str(tmp_path / "qk8")), lm)
    rows = [json.loads(x) for x in (tmp_path / "qk8" / "results.jsonl").read_text().splitlines()]
    assert all(r["pool_tokens"] == 448 and r["resident_chunks"] <= 7 for r in rows)
    assert summary["overall"] >= 0.75, [r["answer"] for r in rows]


def test_a_pinned_needle_arm_pins_exactly_the_needle(tmp_path) -> None:
    cfg = small(tmp_path, pin_needle=True, trials=1, lengths=(512,))
    arm = HalfBlind()
    summary = run_grid(Grid(cfg), arm)
    template = cfg.needle_template()
    rows = [json.loads(line) for line in (tmp_path / "arm" / "results.jsonl").read_text().splitlines()]
    assert len(arm.pinned) == len(rows) == len(cfg.depths)
    for text, row in zip(arm.pinned, rows, strict=True):
        assert text.startswith(template.needle.split("{")[0]) and row["value"] in text
    assert "needle pinned" in summary["arm"]
