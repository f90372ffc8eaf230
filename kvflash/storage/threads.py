"""`Threads`: a store's pool of threads, and `map`, which runs a function over indices on it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


class Threads:
    """n threads (named `<name>_<i>`); safe to use from any thread."""

    def __init__(self, n: int, name: str):
        self.n = n
        self._pool = ThreadPoolExecutor(n, thread_name_prefix=name)

    def submit(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def map(self, fn: Callable[[int], T], n: int) -> list[T]:
        """[fn(0), ..., fn(n - 1)], as one task per thread that takes the next index whenever it
        finishes one. A future per chunk cost each chunk a wake-up of the waiting caller
        (Future.set_result notifies under the GIL) and a Future with its Condition: 40-55% of the
        GIL-holding samples of a restore. After a failure the tasks stop taking indices, and the
        failure of the lowest index is raised."""
        results: dict[int, T] = {}
        failures: list[tuple[int, BaseException]] = []
        indices = iter(range(n))  # next() on it is atomic under the GIL

        def run() -> None:
            for i in indices:
                if failures:
                    return
                try:
                    results[i] = fn(i)
                except BaseException as e:
                    failures.append((i, e))

        for task in [self._pool.submit(run) for _ in range(min(self.n, n))]:
            task.result()
        if failures:
            raise min(failures, key=lambda f: f[0])[1]
        return [results[i] for i in range(n)]

    def shutdown(self, cancel_futures: bool = False) -> None:
        """Waits for the tasks running; with `cancel_futures`, those not started never run."""
        self._pool.shutdown(cancel_futures=cancel_futures)
