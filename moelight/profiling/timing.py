"""The best-of-n wall-clock timers the profilers share."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], None], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    """Fastest of `repeat` timed calls after one warm-up (allocations, kernel selection, JIT); `sync`
    waits for asynchronous work (a GPU stream) so the time covers it."""
    return fastest_in_rounds([fn], repeat, sync)[0]


def fastest_in_rounds(passes: list[Callable[[], None]], rounds: int,
                      sync: Callable[[], None] = lambda: None) -> list[float]:
    """Each pass's fastest time over `rounds` rounds of all of them, after one warm-up of the first: a
    curve's points. A point's samples are a round apart, so a slow phase of a shared host that spans
    a few back-to-back passes takes one sample of each point, not every sample of one."""
    passes[0]()
    sync()
    best = [float("inf")] * len(passes)
    for _ in range(rounds):
        for i, one in enumerate(passes):
            t0 = time.perf_counter()
            one()
            sync()
            best[i] = min(best[i], time.perf_counter() - t0)
    return [max(t, 1e-9) for t in best]
