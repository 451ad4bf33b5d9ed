"""The best-of-n wall-clock timer the profilers share."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], None], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Fastest of `repeat` timed calls after one warm-up (allocations, kernel selection, JIT); `sync`
    waits for asynchronous work (a GPU stream) so the time covers it."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)
