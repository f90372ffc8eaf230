"""`Outbox`: items for an event loop's queues, handed over from the scheduler's thread in batches.

Every token of every streamed answer crosses from the scheduler's thread to the event loop. A
`call_soon_threadsafe` a token writes to the loop's wake-up pipe each time (14 µs on a 2-core VM,
about as much as decoding and stop-checking the token), so a decode step of 32 streams made 32
such calls on the thread the engine runs on. Here the first item after a hand-over schedules the
next one and the items that follow before the loop runs it join it: one call and one wake-up a
step, whatever the streams.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        """Queues item for `queue` (from any thread); it arrives after the items put before it."""
        with self._lock:
            first = not self._items
            self._items.append((queue, item))
        if first:
            try:
                self.loop.call_soon_threadsafe(self._hand_over)
            except RuntimeError:  # the event loop has stopped (the server is stopping): nobody listens
                pass

    def _hand_over(self) -> None:
        with self._lock:
            items, self._items = self._items, []
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
