"""Needle in a haystack: one arm (policy, pool, mode) over a grid of lengths × depths × trials.

Each trial hides its own seeded needle in filler at a relative depth, asks for it after the document
and scores RULER's way: a hit when the exact value string is in the answer. Rows are appended to
`results.jsonl` as trials finish, so a rerun with the same output directory resumes where it stopped;
`summary.json`, `heatmap.png` and a table are rebuilt from all rows at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvflash import KVFlashError
from kvflash.config import CACHE_ORDERS, KV_DTYPES, POLICIES, EngineConfig, ResidencyConfig
from kvflash.engine.engine import Engine
from kvflash.eval.haystack import TEMPLATES, Haystack, NeedleTemplate, build_haystack, filler_sentences
from kvflash.eval.niah_report import cell_key, heatmap, summarize
from kvflash.models.loader import LoadedModel, load_model
from kvflash.serve.pins import Pin
from kvflash.serve.prompt import encode_messages
from kvflash.serve.session import Document, Session, system_message
from kvflash.serve.turn import TurnStats
from kvflash.storage import SnapshotStore
from kvflash.storage.codec import CODEC_NAMES
from kvflash.text_file import read_text

MODES = ("cold", "restore", "lazy")
ROW_FIELDS = ("length", "depth", "trial", "hit", "ttft_s")
"""What a results row must hold (numbers) to count as a trial done."""
NEUTRAL_QUESTION = "Summarise the document in one sentence."
"""Asked by the session that stores the document in restore modes: it only needs the prefill."""
ARM_FIELDS = (
    "pool_tokens", "budget_frac", "policy", "mode", "cache_positions", "cache_order", "scout_reads", "codec",
    "template", "haystack", "needle", "question", "seed", "max_tokens", "model", "dtype", "kv_dtype",
    "pin_needle",
)  # fmt: skip
"""Settings that change answers: a resumed run must agree on all of them (the grid may grow)."""
LENGTH_TOLERANCE = 0.03
"""A haystack whose document misses its target length by more than this share (or 32 tokens, about
two sentences, whichever is more) is refused: its filler could not be cut at sentence boundaries."""


@dataclass(frozen=True)
class NiahConfig:
    lengths: tuple[int, ...] = (2048, 4096, 8192)
    """Document lengths in tokens (the prompt adds the system text and the question)."""
    depths: tuple[float, ...] = tuple(i / 10 for i in range(11))
    trials: int = 4
    pool_tokens: int | None = None
    budget_frac: float | None = None
    """Pool as a share of each length, in whole chunks, at least the residency floor."""
    policy: str = "full"
    mode: str = "cold"
    cache_positions: bool = True
    """ResidencyConfig.cache_positions: off attends at absolute positions (the A/B arm)."""
    cache_order: str = "document"
    """ResidencyConfig.cache_order."""
    scout_reads: int = 0
    """ResidencyConfig.scout_reads: what a lazily restored question's scouts read to score from keys."""
    codec: str = "lossless"
    """The snapshot codec in restore modes: lossless, or fp8 to check that its error spares the needle."""
    template: str = "passcode"
    haystack: str | None = None
    """A text file used as filler (repeated as needed) instead of the built-in generator."""
    needle: str | None = None
    question: str | None = None
    seed: int = 0
    max_tokens: int = 32
    pin_needle: bool = False
    """Pin the needle's characters (`--pin`): the arm that shows a pin is kept whatever the pool."""
    out: str = "niah-out"
    model: str | None = None
    dtype: str | None = None
    kv_dtype: str = "auto"
    """EngineConfig.kv_dtype."""
    device: str | None = None

    def __post_init__(self) -> None:
        if not self.lengths or any(n < 64 for n in self.lengths):
            raise KVFlashError("lengths must be at least 64 tokens each")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise KVFlashError("depths must lie in 0..1")
        if self.trials < 1 or self.max_tokens < 1:
            raise KVFlashError("trials and max_tokens must be positive")
        if self.policy not in POLICIES:
            raise KVFlashError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.cache_order not in CACHE_ORDERS:
            raise KVFlashError(
                f"unknown cache order {self.cache_order!r}; choose one of {', '.join(CACHE_ORDERS)}"
            )
        if self.mode not in MODES:
            raise KVFlashError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.codec not in CODEC_NAMES:
            raise KVFlashError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODEC_NAMES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise KVFlashError(f"unknown KV dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
        if self.template not in TEMPLATES:
            raise KVFlashError(f"unknown template {self.template!r}; choose one of {', '.join(TEMPLATES)}")
        self._check_pool()
        self.needle_template()

    def _check_pool(self) -> None:
        given = (self.pool_tokens is not None) + (self.budget_frac is not None)
        if self.policy == "full":
            if given:
                raise KVFlashError(
                    "policy full sizes the pool to the whole prompt; drop --pool-tokens/--budget-frac"
                )
            return
        if given != 1:
            raise KVFlashError(f"policy {self.policy} needs exactly one of --pool-tokens or --budget-frac")
        floor = ResidencyConfig().floor_chunks() * ResidencyConfig().chunk_tokens
        if self.pool_tokens is not None and self.pool_tokens < floor:
            raise KVFlashError(f"a pool of {self.pool_tokens} tokens is below the floor of {floor} tokens")
        if self.budget_frac is not None and not 0.0 < self.budget_frac <= 1.0:
            raise KVFlashError(f"--budget-frac must lie in (0, 1], not {self.budget_frac}")

    def needle_template(self) -> NeedleTemplate:
        base = TEMPLATES[self.template]
        t = NeedleTemplate(self.needle or base.needle, self.question or base.question)
        if "{value}" not in t.needle:
            raise KVFlashError("the needle template must contain {value}")
        try:
            t.needle.format(value="1", key="k")
            t.question.format(key="k")
        except (KeyError, IndexError, ValueError) as e:
            raise KVFlashError(
                f"bad needle or question template ({e!r}); fields: {{value}}, {{key}}"
            ) from None
        return t

    def to_dict(self) -> dict:
        """As JSON holds it (tuples become lists), so saved and live configs compare equal."""
        return json.loads(json.dumps(asdict(self)))

    def arm(self) -> dict:
        return {k: v for k, v in self.to_dict().items() if k in ARM_FIELDS}

    @property
    def label(self) -> str:
        if self.policy == "full":
            pool = "full"
        elif self.pool_tokens is not None:
            pool = f"{self.policy} @ {self.pool_tokens} tok"
        else:
            inv = 1 / self.budget_frac
            share = f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 else f"{self.budget_frac:g}"
            pool = f"{self.policy} @ {share} of length"
        codec = f", {self.codec}" if self.codec != "lossless" and self.mode != "cold" else ""
        absolute = ", absolute positions" if not self.cache_positions and self.policy != "full" else ""
        order = ", score order" if self.cache_order == "score" and self.policy != "full" else ""
        reads = f", {self.scout_reads} scout reads" if self.scout_reads and self.policy != "full" else ""
        pinned = ", needle pinned" if self.pin_needle else ""
        kv = f", {self.kv_dtype} KV" if self.kv_dtype != "auto" else ""
        return f"{pool}, {self.mode}{codec}{absolute}{order}{reads}{pinned}{kv}"

    def engine_config(self) -> EngineConfig:
        """The engine of this arm's trials but for its pool (`pool_for`)."""
        res = ResidencyConfig(
            policy=self.policy,
            cache_positions=self.cache_positions,
            cache_order=self.cache_order,
            scout_reads=self.scout_reads,
        )
        return EngineConfig(residency=res, kv_dtype=self.kv_dtype)

    def pool_for(self, length: int, prompt_tokens: int) -> int:
        """Pool tokens for one trial: the whole prompt and answer under full, else the configured share."""
        res = ResidencyConfig()
        c = res.chunk_tokens
        if self.policy == "full":
            return math.ceil((prompt_tokens + self.max_tokens) / c) * c
        if self.pool_tokens is not None:
            return self.pool_tokens
        return max(math.ceil(self.budget_frac * length / c), res.floor_chunks()) * c


def trial_seed(seed: int, length: int, depth: float, trial: int) -> int:
    """A seed per (run seed, cell, trial): every trial of every cell gets its own needle and filler."""
    key = f"{seed}:{length}:{depth:.4f}:{trial}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big")


def make_haystack(
    length: int,
    depth: float,
    seed: int,
    count_tokens: Callable[[str], int],
    template: NeedleTemplate,
    filler_text: str | None = None,
) -> Haystack:
    """build_haystack fed with enough filler to trim from: its own estimate (4 characters a token)
    falls about 18% short of SmolLM2's real counts on the generated prose."""
    want = int(length * 1.1) + 64
    if filler_text is None:
        sents, parts, n = filler_sentences(random.Random(seed ^ 0x5EED)), [], 0
        while n < want:
            parts.append(next(sents))
            n += count_tokens(parts[-1]) + 1
        filler = " ".join(parts)
    else:
        filler = " ".join([filler_text.strip()] * math.ceil(want / max(1, count_tokens(filler_text))))
    hay = build_haystack(length, depth, seed, count_tokens, template, filler)
    got = count_tokens(hay.document)
    if abs(got - length) > max(LENGTH_TOLERANCE * length, 32):
        raise KVFlashError(
            f"could not cut the haystack to {length} tokens (got {got}); "
            "filler text must have sentences ending in '. '"
        )
    return hay


@dataclass
class Answer:
    text: str
    stats: TurnStats
    pool_tokens: int
    prompt_tokens: int


class Answerer(Protocol):
    """What the grid needs from a model: token counts and an answer per trial (tests use a stand-in)."""

    def count_tokens(self, text: str) -> int: ...

    def answer(
        self, length: int, document: str, question: str, pin: tuple[int, int] | None = None
    ) -> Answer: ...

    """`pin`: characters [start, end) of the document to keep resident."""


class ModelArm:
    """Answers trials with a loaded model under the config's policy, pool and mode.

    One Engine while the trials' pool size stays the same (an engine pins its host tier and warms
    its kernels when it starts; a fixed --pool-tokens grid pays that once), a new one when it
    changes; in restore modes one store under `<out>/store`, emptied after each trial so a full grid
    does not fill the disk.
    """

    def __init__(self, cfg: NiahConfig, lm: LoadedModel, engine: EngineConfig | None = None):
        """`engine`: the EngineConfig every trial's engine follows but for its pool (default: the
        config's policy, positions and KV dtype, the rest the engine's defaults)."""
        self.cfg, self.lm, self.tok = cfg, lm, lm.tokenizer
        self.engine_cfg = engine or cfg.engine_config()
        self.store = SnapshotStore(Path(cfg.out) / "store", cfg.codec) if cfg.mode != "cold" else None
        self._engine: Engine | None = None

    def count_tokens(self, text: str) -> int:
        return len(self.tok.encode_plain(text))

    def answer(self, length: int, document: str, question: str, pin: tuple[int, int] | None = None) -> Answer:
        docs = [Document("haystack.txt", document)]
        prompt = encode_messages(self.tok, [system_message(docs), {"role": "user", "content": question}])
        pool = self.cfg.pool_for(length, len(prompt))
        engine = self._engine_for(pool)
        if self.store is not None:
            self._ask(Session(engine, docs, self.store), NEUTRAL_QUESTION, 1)
        lazy = {"cold": None, "restore": False, "lazy": True}[self.cfg.mode]
        pins = [Pin("chars", "0", *pin)] if pin else []
        sess = Session(engine, docs, self.store, lazy=lazy, pins=pins)
        text, stats = self._ask(sess, question, self.cfg.max_tokens)
        if self.store is not None:
            for s in self.store.list_snapshots():
                self.store.rm(s.id)
        return Answer(text, stats, pool, len(prompt))

    def _engine_for(self, pool: int) -> Engine:
        if self._engine is None or self._engine.cfg.pool_tokens != pool:
            self._engine = None  # the old pool's memory goes before the new one is allocated
            self._engine = Engine(self.lm, dataclasses.replace(self.engine_cfg, pool_tokens=pool))
        return self._engine

    @staticmethod
    def _ask(sess: Session, question: str, max_tokens: int) -> tuple[str, TurnStats]:
        try:
            return sess.ask(question, max_tokens)
        finally:
            sess.close()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class Grid:
    """The output directory of one arm: its saved config, filler and the rows done so far.

    Opening it refuses a directory saved by another arm, so one results.jsonl never mixes arms."""

    def __init__(self, cfg: NiahConfig):
        self.cfg, self.out = cfg, Path(cfg.out)
        self.filler = self._read_filler()
        self.out.mkdir(parents=True, exist_ok=True)
        saved = self.out / "config.json"
        if saved.exists():
            self._check_arm(saved)
        saved.write_text(json.dumps(cfg.to_dict(), indent=2))
        self.results = self.out / "results.jsonl"
        self.rows = self._read_rows()

    def _read_filler(self) -> str | None:
        if self.cfg.haystack is None:
            return None
        return read_text(Path(self.cfg.haystack), "haystack file")

    def _check_arm(self, saved: Path) -> None:
        try:
            old = json.loads(saved.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = None
        if not isinstance(old, dict):
            raise KVFlashError(f"{saved} is not a grid's readable JSON; use another --out")
        new = self.cfg.arm()
        old.setdefault("codec", "lossless")  # saved before these fields existed
        old.setdefault("cache_order", "document")
        old.setdefault("scout_reads", 0)
        diff = [k for k in ARM_FIELDS if old.get(k) != new[k]]
        if diff:
            detail = ", ".join(f"{k} {old.get(k)!r} -> {new[k]!r}" for k in diff)
            raise KVFlashError(f"{self.out} holds results of another arm ({detail}); use another --out")

    def _read_rows(self) -> list[dict]:
        """Rows done so far; a row cut short by a crash, or not a trial's row, is dropped (and its
        trial redone)."""
        if not self.results.exists():
            return []
        text = self.results.read_text()
        lines = text.splitlines()
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and all(isinstance(row.get(k), int | float) for k in ROW_FIELDS):
                rows.append(row)
        if len(rows) != len(lines) or not text.endswith("\n"):
            self.results.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def todo(self) -> list[tuple[int, float, int]]:
        done = {cell_key(r["length"], r["depth"], r["trial"]) for r in self.rows}
        grid = [
            cell_key(n, d, t)
            for n in self.cfg.lengths
            for d in self.cfg.depths
            for t in range(self.cfg.trials)
        ]
        return [k for k in grid if k not in done]

    def add(self, row: dict) -> None:
        with open(self.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.rows.append(row)


def run_trial(cfg: NiahConfig, arm: Answerer, key: tuple[int, float, int], filler: str | None) -> dict:
    length, depth, trial = key
    t0 = time.perf_counter()
    seed = trial_seed(cfg.seed, length, depth, trial)
    hay = make_haystack(length, depth, seed, arm.count_tokens, cfg.needle_template(), filler)
    pin = (hay.needle_char, hay.needle_char + hay.needle_len) if cfg.pin_needle else None
    a = arm.answer(length, hay.document, hay.question, pin)
    s = a.stats
    return {
        "length": length, "depth": depth, "trial": trial, "seed": seed, "value": hay.value,
        "trial_s": round(time.perf_counter() - t0, 3),
        "hit": hay.value in a.text, "answer": a.text, "doc_tokens": arm.count_tokens(hay.document),
        "prompt_tokens": a.prompt_tokens, "ttft_s": round(s.ttft_s, 4), "restore_s": round(s.restore_s, 4),
        "source": s.source, "restored_tokens": s.restored_tokens, "prefilled_tokens": s.prefilled_tokens,
        "resident_chunks": s.resident_chunks, "pinned_chunks": s.pinned_chunks, "bytes_moved": s.bytes_moved,
        "policy": cfg.policy, "mode": cfg.mode, "pool_tokens": a.pool_tokens, "budget_frac": cfg.budget_frac,
    }  # fmt: skip


def run_grid(grid: Grid, arm: Answerer, progress: Console | None = None) -> dict:
    """Runs the trials not yet in the output directory, then writes summary.json and heatmap.png.

    The progress bar goes to `progress`; None runs quietly."""
    cfg, todo = grid.cfg, grid.todo()
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=progress, disable=progress is None,
    ) as bar:  # fmt: skip
        task = bar.add_task(cfg.label, total=len(todo))
        for key in todo:
            bar.update(task, description=f"{cfg.label}  L={key[0]} depth={key[1]:.2f} trial={key[2]}")
            grid.add(run_trial(cfg, arm, key, grid.filler))
            bar.advance(task)
    return finish(grid)


def finish(grid: Grid) -> dict:
    """Writes summary.json and heatmap.png from every row of the grid; returns the summary."""
    summary = summarize(grid.cfg, grid.rows)
    (grid.out / "summary.json").write_text(json.dumps(summary, indent=2))
    heatmap(summary, grid.out / "heatmap.png")
    return summary


def run(
    cfg: NiahConfig,
    lm: LoadedModel | None = None,
    progress: Console | None = None,
    engine: EngineConfig | None = None,
) -> dict:
    """The harness on a real model: checks the output directory, loads the model once (not at all
    when every trial is done already), runs the grid. `engine`: as `ModelArm`'s."""
    grid = Grid(cfg)
    if not grid.todo():
        return finish(grid)
    arm = ModelArm(cfg, lm or load_model(cfg.model, dtype=cfg.dtype, device=cfg.device), engine)
    try:
        return run_grid(grid, arm, progress)
    finally:
        arm.close()
