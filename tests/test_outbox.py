"""The hand-over of streamed items from the scheduler's thread to the event loop (serve/outbox.py)."""

from __future__ import annotations

import asyncio
import threading

from kvflash.serve.outbox import Outbox, outbox_of


def test_items_put_while_the_loop_is_busy_arrive_in_order_in_one_hand_over() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        box = outbox_of(loop)
        assert outbox_of(loop) is box
        box.gap = 0.0  # unpaced: each batch goes when the loop is free
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
            assert scheduled.count(box._pace) == batch + 1, "one hand-over a batch"
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


def test_hand_overs_are_paced_but_urgent_items_go_at_once() -> None:
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        box, q = Outbox(loop, gap=0.3), asyncio.Queue()

        async def take(n: int) -> tuple[list, float]:
            got = [await q.get() for _ in range(n)]
            return got, loop.time()

        t0 = loop.time()
        box.put(q, "first", urgent=True)
        assert asyncio.run_coroutine_threadsafe(take(1), loop).result(5)[0] == ["first"]
        for i in range(3):  # within the gap of that hand-over: they wait for it, then go together
            box.put(q, i)
        got, at = asyncio.run_coroutine_threadsafe(take(3), loop).result(5)
        assert got == [0, 1, 2] and at - t0 >= 0.3
        t1 = loop.time()
        box.put(q, "paced")
        box.put(q, "end", urgent=True)  # takes the paced one with it, in order, before the gap
        got, at = asyncio.run_coroutine_threadsafe(take(2), loop).result(5)
        assert got == ["paced", "end"] and at - t1 < 0.3
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
    loop.close()
