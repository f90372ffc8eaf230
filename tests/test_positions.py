"""CachePositions: where each resident chunk sits within the cache, in the document's order or by
score, and the rotation that moves its keys there."""

from __future__ import annotations

import pytest
import torch

from kvflash import KVFlashError
from kvflash.config import ResidencyConfig
from kvflash.engine.positions import CachePositions
from kvflash.models.rope import inv_frequencies
from tests.tiny import tiny_config

CFG = tiny_config()
C = 16
ORDER = [0, 3, 5, 7, 9, 10, 11, 12]
"""The sink 0, chunks 3, 5 and 7 between it and the tail, the tail 9 and 10, and the step's own
chunks 11 and 12 (its first is 11); chunks 1, 2, 4, 6 and 8 are evicted."""
SCORES = [5.0, 0.9, 0.1, 0.5, 0.0, 0.0, float("-inf"), float("-inf")]
"""The sink scores best, then chunk 3, 7 and 5; the tail's and the step's scores do not place them."""


def positions(cache_order: str) -> CachePositions:
    res = ResidencyConfig(chunk_tokens=C, sink_chunks=1, tail_chunks=2, cache_order=cache_order)
    return CachePositions(CFG, res, torch.device("cpu"))


def rotation(shift_chunks: list[int]) -> torch.Tensor:
    ang = torch.tensor(shift_chunks, dtype=torch.float32)[:, None] * C * inv_frequencies(CFG)
    return torch.stack([ang.cos(), ang.sin()], 1)


def test_document_order_closes_the_gaps_in_the_documents_order() -> None:
    """The step's first chunk 11 keeps its position at place 6 of 8, so place p sits at chunk 5 + p."""
    pos = positions("document")
    assert pos.layout(ORDER, 11, SCORES) == ORDER
    torch.testing.assert_close(pos.listed(ORDER, 11, SCORES), rotation([5, 3, 2, 1, 0, 0, 0, 0]))
    assert torch.equal(pos.listed(ORDER, 11, SCORES), pos.listed(ORDER, 11, [0.0] * 8))  # scores unread


def test_score_order_puts_the_best_chunk_before_the_tail_just_before_it() -> None:
    """Chunks 5, 7, 3 and the sink 0 (ascending scores) take places 0 to 3: the sink, which scores
    best, sits just before the tail; the tail and the step's own chunks keep the places, and the
    rotations, that the document's order gives them."""
    pos = positions("score")
    assert pos.layout(ORDER, 11, SCORES) == [5, 7, 3, 0, 9, 10, 11, 12]
    rot = pos.listed(ORDER, 11, SCORES)  # rows follow ORDER: the sink moves 8 chunks on, 7 one back
    torch.testing.assert_close(rot, rotation([8, 4, 0, -1, 0, 0, 0, 0]))
    kept = [4, 5, 6, 7]
    assert torch.equal(rot[kept], positions("document").listed(ORDER, 11, SCORES)[kept])


def test_score_order_breaks_ties_by_index_and_moves_nothing_where_nothing_is_evicted() -> None:
    pos = positions("score")
    assert pos.layout(ORDER, 11, [1.0] * 8) == ORDER
    assert pos.listed(list(range(13)), 11, [float(-i) for i in range(13)]) is None


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(cache_order="random"), "unknown cache order"),
        (dict(cache_order="score", cache_positions=False), "needs positions within the cache"),
    ],
)
def test_bad_cache_orders_are_refused(over: dict, message: str) -> None:
    with pytest.raises(KVFlashError, match=message):
        ResidencyConfig(**over)
