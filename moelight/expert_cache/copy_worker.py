"""The expert cache's link: one thread copying experts host -> device slot, in priority order.

Demand fetches (a layer is waiting) go before every queued prefetch; prefetches go by priority;
a copy under way finishes (experts are not split). A fetch whose expert was evicted before its
copy started is cancelled. A slot is not overwritten before the compute that last read it has
finished (its event, on devices whose compute is asynchronous).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable

from moelight.expert_cache.cache_state import Fetch
from moelight.pipeline.device_base import Device


class CopyWorker:
    def __init__(self, device: Device, pairs: Callable[[Fetch], list], nbytes: int) -> None:
        """pairs(fetch) -> the (device slot view, host tensor) pairs that fetch copies."""
        self.device, self.pairs, self.nbytes = device, pairs, nbytes
        self.cond = threading.Condition()
        self.heap: list[tuple] = []
        self.waiting: dict[int, tuple] = {}  # key -> heap entry not started
        self.done: dict[int, threading.Event] = {}  # key -> set when its latest copy has been issued
        self.device_done: dict[int, object] = {}  # key -> device event of that copy (CUDA)
        self.slot_free: dict[int, object] = {}  # slot -> event after the compute that last read it
        self.copied_bytes = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="moelight-expert-copy", daemon=True)
        self.thread.start()

    def submit(self, fetches: list[Fetch]) -> None:
        with self.cond:
            for f in fetches:
                entry = (0 if f.demand else 1, -f.priority, f.order, f)
                self.waiting[f.key] = entry
                self.done[f.key] = threading.Event()
                heapq.heappush(self.heap, entry)
            self.cond.notify_all()

    def cancel(self, key: int) -> bool:
        with self.cond:
            return self.waiting.pop(key, None) is not None

    def pending(self, key: int) -> bool:
        """Whether the copy of `key` has not been issued yet."""
        ev = self.done.get(key)
        return ev is not None and not ev.is_set()

    def wait(self, key: int) -> None:
        """Block until `key`'s copy is issued, then make compute wait for it on the device."""
        ev = self.done.get(key)
        if ev is not None:
            while not ev.wait(timeout=0.5):
                if self.error is not None:
                    raise RuntimeError(f"expert copy failed: {self.error!r}") from self.error
        self.device.wait_event(self.device_done.get(key))

    def used(self, slots: list[int]) -> None:
        """The compute that reads these slots has been issued: later copies into them wait for it."""
        ev = self.device.record_event()
        for s in slots:
            self.slot_free[s] = ev

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.heap and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                entry = heapq.heappop(self.heap)
                f = entry[3]
                if self.waiting.get(f.key) is not entry:
                    continue  # cancelled or superseded
                del self.waiting[f.key]
            try:
                self.device_done[f.key] = self.device.transfer(self.pairs(f), after=self.slot_free.get(f.slot))
                self.copied_bytes += self.nbytes
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self.error = e
            self.done[f.key].set()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=5)
