"""Mixed steps (kvflash/engine/step.py), on a tiny random-weight model: decode tokens and prefill pieces of
several sequences in one forward compute what each computes alone, and the scheduler puts the
prompts of many waiting requests into one step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflash.engine.paged_kv import PagedKV
from kvflash.engine.step import PieceBatch
from kvflash.models.loader import LoadedModel
from kvflash.serve.scheduler import Scheduler
from tests.test_scheduler import CFG, engine, prompt, run_jobs
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def lm() -> LoadedModel:
    return LoadedModel(tiny_model(CFG), None, CFG, Path("tiny"), torch.float32, torch.device("cpu"))


def test_decode_tokens_and_prefill_pieces_in_one_forward_compute_what_they_compute_alone(lm) -> None:
    """Two decoding sequences (one beyond its budget: evicting) and three prefills, one of them long
    enough to take several pieces, teacher-forced: the logits of every mixed step equal the ones
    each part gets in its own forward."""
    runs = []
    for mixed in (False, True):
        eng = engine(lm)
        decoding = [eng.new_sequence(96) for _ in range(2)]
        for i, (kv, n) in enumerate(zip(decoding, (40, 230), strict=True)):
            eng.prefill(kv, prompt(n, i))
        filling = [eng.new_sequence(96) for _ in range(3)]
        plans = [
            eng.plan_prefill(kv, prompt(n, 5 + i))
            for i, (kv, n) in enumerate(zip(filling, (9, 33, 70), strict=True))
        ]
        out, t = [], 0
        while plans:
            tokens = [(7 * t + 3 * i) % CFG.vocab_size for i in range(len(decoding))]
            pieces = [p.next(24) for p in plans]
            if mixed:
                dec, fill = eng.forward(decoding, tokens, pieces)
            else:
                dec = torch.stack(
                    [eng.decode_batch([kv], [tok])[0] for kv, tok in zip(decoding, tokens, strict=True)]
                )
                fill = torch.stack([eng.forward([], [], [p])[1][0] for p in pieces])
            out.append(torch.cat([dec, fill]))
            for p, piece in zip(list(plans), pieces, strict=True):
                p.ran(piece)
                if piece.final:
                    plans.remove(p)
            t += 1
        assert t > 2 and any(kv.approximate for kv in decoding)  # several pieces; an evicting sequence
        assert [len(kv.seq) for kv in filling] == [9, 33, 70]
        runs.append(out)
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_pieces_attending_in_one_launch_score_the_chunks_as_each_does_alone(lm, monkeypatch) -> None:
    """Three prefills over budgets of a few chunks, a step's pieces attending in one launch a layer
    (`PieceBatch`: on the GPU the Triton kernels', here their torch twins'): each piece whose step
    scores the chunks keeps its own rows' queries, so every step's logits and each sequence's
    scores equal those of its own forward."""
    monkeypatch.setattr(
        PagedKV,
        "joins_batched_prefill",
        property(lambda kv: len(kv.plan.ids) > 1 and kv.plan.listing.rot is None),
    )
    scoring = []
    of = PieceBatch.of.__func__

    def counted(cls, pieces):
        if (batch := of(cls, pieces)) is not None:
            scoring.append(len(batch.scoring))
        return batch

    monkeypatch.setattr(PieceBatch, "of", classmethod(counted))
    runs = []
    for together in (False, True):
        eng = engine(lm, 1024)
        seqs = [eng.new_sequence(b) for b in (128, 160, 512)]
        plans = [
            eng.plan_prefill(kv, prompt(n, 3 + i))
            for i, (kv, n) in enumerate(zip(seqs, (200, 260, 150), strict=True))
        ]
        logits, scores = [], []
        while plans:
            pieces = [p.next(32) for p in plans]
            if together:
                logits.append(eng.forward([], [], pieces)[1])
            else:
                logits.append(torch.cat([eng.forward([], [], [p])[1] for p in pieces]))
            scores += [kv.selector.scores for kv in seqs if kv.selector.scores is not None]
            for p, piece in zip(list(plans), pieces, strict=True):
                p.ran(piece)
                if piece.final:
                    plans.remove(p)
        runs.append((logits, scores))
    assert sum(scoring) >= 3, scoring  # steps in one launch whose pieces scored
    (logits_alone, scores_alone), (logits_together, scores_together) = runs
    assert len(scores_alone) == len(scores_together)
    for a, b in zip(logits_alone + scores_alone, logits_together + scores_together, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_waiting_prompts_prefill_together_in_one_step(lm) -> None:
    """Six short prompts queued at once: admitted together, their prefills share forwards (the first
    may be admitted before the others are queued), and each answer is the one it gets alone."""
    prompts = [prompt(12 + 3 * i, 40 + i) for i in range(6)]
    alone = []
    for ids in prompts:
        sched = Scheduler(engine(lm, 1024), None, frozenset(), max_batch=1)
        try:
            alone += run_jobs(sched, [ids], 6)
        finally:
            sched.close()
    sched = Scheduler(engine(lm, 1024), None, frozenset(), max_batch=8)
    try:
        got = run_jobs(sched, prompts, 6)
        assert sched.pieces == 6 and sched.prefill_steps <= 2, (sched.pieces, sched.prefill_steps)
    finally:
        sched.close()
    assert got == alone
