"""Sealed chunks of exact KV by chain hash, in one tier (the GPU pool or the host tier): the map
through which sequences whose prompts share a prefix share its chunks' slots instead of each holding
a copy.

A chain hash names a chunk's KV together with its whole prefix (docs/DESIGN.md, Units), so a flat
map from hash to slot answers a prefix query without a tree: a prompt's chain, walked from its first
chunk, stops at the first hash no tier holds, and the run before it is the longest shared prefix
(`shared_run`). The snapshot store is keyed by the same hashes, so a lookup goes on there where the
pool and the host tier stop.
"""

from __future__ import annotations

from collections.abc import Callable


class ChunkIndex:
    """hash -> slot and slot -> hash. A hash names one slot: a second copy of the same KV (computed
    side by side before either was sealed) stays its sequence's own and is not named. The tier
    forgets a slot when its last reader releases it."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._key: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._slot)

    def add(self, key: str, slot: int) -> None:
        if key not in self._slot and slot not in self._key:
            self._slot[key] = slot
            self._key[slot] = key

    def find(self, key: str) -> int | None:
        return self._slot.get(key)

    def forget(self, slot: int) -> None:
        key = self._key.pop(slot, None)
        if key is not None:
            del self._slot[key]


def shared_run(keys: list[str], *holds: Callable[[str], int | None]) -> int:
    """How many of the first keys some tier holds (each `holds` is a tier's `find`), in order: the
    chunks a prompt with this chain can share."""
    n = 0
    for key in keys:
        if all(find(key) is None for find in holds):
            break
        n += 1
    return n
