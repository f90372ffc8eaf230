"""The hand-over of streamed items from the scheduler's thread to the event loop (serve/outbox.py)."""

from __future__ import annotations

import asyncio
import threading

from kvflash.serve.outbox import outbox_of


def test_items_put_while_the_loop_is_busy_arrive_in_order_in_one_hand_over() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        box = outbox_of(loop)
        assert outbox_of(loop) is box
        scheduled, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: scheduled.append(fn) or real(fn, *a)
        queues = [asyncio.Queue() for _ in range(4)]

        async def drain() -> list[list[int]]:
            return [[q.get_nowait() for _ in range(q.qsize())] for q in queues]

        for batch in range(2):
            busy, release = threading.Event(), threading.Event()
            real(lambda b=busy, r=release: (b.set(), r.wait(5)))  # the loop is inside a callback
            assert busy.wait(5)
            for i in range(100):
                box.put(queues[i % 4], (batch, i))
            release.set()
            got = asyncio.run_coroutine_threadsafe(drain(), loop).result(5)
            assert got == [[(batch, i) for i in range(k, 100, 4)] for k in range(4)]
            assert scheduled.count(box._hand_over) == batch + 1, "one hand-over a batch"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
    loop.close()
    box.put(asyncio.Queue(), "late")  # a stopped loop: nobody listens, nothing raises
    other = asyncio.new_event_loop()
    try:
        assert outbox_of(other) is not box
    finally:
        other.close()
