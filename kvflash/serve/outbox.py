"""`Outbox`: items for an event loop's queues, handed over from the scheduler's thread in batches.

Every token of every streamed answer crosses from the scheduler's thread to the event loop, and
both share one interpreter lock. A `call_soon_threadsafe` a token writes to the loop's wake-up pipe
each time, so the first item after a hand-over schedules the next one and the items that follow
join it: one call and one wake-up for many streams. Hand-overs are also paced, at most one every
`gap` seconds, so that a stream takes the tokens of several decode steps in one wake-up and one
write (`routes._stream` sends what its queue holds as one body): each write of a server-sent event
costs the loop about as much Python as the scheduler spends on a token, while the events' text is
cheap. An `urgent` item (a stream's first text, its end) is handed over at once, with everything
waiting, so pacing costs neither time to first token nor the end of an answer.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

GAP_S = 0.008
"""Least time between two hand-overs: a decode step of many streams takes a few milliseconds, and a
reader sees no difference between tokens every 3 ms and three tokens every 8 ms."""


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, gap: float = GAP_S):
        self.loop, self.gap = loop, gap
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()
        self._last = float("-inf")  # loop time of the last hand-over (read and set on the loop)

    def put(self, queue: asyncio.Queue, item: Any, urgent: bool = False) -> None:
        """Queues item for `queue` (from any thread); it arrives after the items put before it."""
        with self._lock:
            first = not self._items
            self._items.append((queue, item))
        if first or urgent:
            try:
                self.loop.call_soon_threadsafe(self._hand_over if urgent else self._pace)
            except RuntimeError:  # the event loop has stopped (the server is stopping): nobody listens
                pass

    def _pace(self) -> None:
        wait = self._last + self.gap - self.loop.time()
        if wait > 0:
            self.loop.call_later(wait, self._hand_over)
        else:
            self._hand_over()

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        if not items:  # an urgent hand-over took them before this paced one came due
            return
        self._last = self.loop.time()
        for queue, item in items:
            queue.put_nowait(item)


_outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}
_made = threading.Lock()


def outbox_of(loop: asyncio.AbstractEventLoop) -> Outbox:
    """The one outbox of an event loop (a server runs one loop; tests run several, one after
    another: those of closed loops are dropped here)."""
    with _made:
        for old in [lp for lp in _outboxes if lp.is_closed()]:
            del _outboxes[old]
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = Outbox(loop)
        return box
