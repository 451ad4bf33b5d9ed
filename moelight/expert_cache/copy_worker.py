"""The expert cache's link: one thread copying experts host -> device slot, in priority order.

Demand fetches (a layer is waiting) go before every queued prefetch; prefetches go by priority.
An expert moves in `chunks` pieces (ProMoE: its three matrices), so a demand waits at most for
the chunk under way; a prefetch whose expert is needed now is promoted to demand. A fetch whose
expert was evicted before it finished is cancelled. A slot is not overwritten before the compute
that last read it has finished (its event, on devices whose compute is asynchronous), and compute
waits for a copy on the device (`wait_event`), not on the host: a copy issued is not a copy done.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from moelight.devices.device_base import Device
from moelight.expert_cache.cache_state import Fetch


@dataclass
class _Job:
    fetch: Fetch
    demand: bool
    chunks: list  # the (dst, src) pairs still to copy, one list per chunk
    done: threading.Event = field(default_factory=threading.Event)
    version: int = 0

    def rank(self) -> tuple:
        return (0 if self.demand else 1, -self.fetch.priority, self.fetch.order, self.version)


class CopyWorker:
    def __init__(self, device: Device, chunks: Callable[[Fetch], list[list]]) -> None:
        """chunks(fetch) -> the fetch's copies as chunks, each a list of (device view, host tensor) pairs."""
        self.device, self.split = device, chunks
        self.cond = threading.Condition()
        self.heap: list[tuple] = []
        self.jobs: dict[int, _Job] = {}  # key -> its copy, not finished
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
                job = _Job(f, f.demand, self.split(f))
                self.jobs[f.key] = job
                self.done[f.key] = job.done
                heapq.heappush(self.heap, (*job.rank(), id(job), job))
            self.cond.notify_all()

    def promote(self, key: int) -> None:
        with self.cond:
            job = self.jobs.get(key)
            if job is not None and not job.demand:
                job.demand, job.version = True, job.version + 1
                job.fetch.priority = float("inf")
                heapq.heappush(self.heap, (*job.rank(), id(job), job))
                self.cond.notify_all()

    def cancel(self, key: int) -> bool:
        """Drop the rest of an evicted expert's copy; True if none of it had moved."""
        with self.cond:
            job = self.jobs.pop(key, None)
            return job is not None and len(job.chunks) == len(self.split(job.fetch))

    def pending(self, key: int) -> bool:
        """Whether the copy of `key` has not finished being issued."""
        ev = self.done.get(key)
        return ev is not None and not ev.is_set()

    def wait(self, key: int) -> None:
        """Block until `key`'s copy is issued, then make compute wait for it on the device."""
        ev = self.done.get(key)
        if ev is not None:
            while not ev.wait(timeout=0.5) and self.error is None:
                pass
        if self.error is not None:  # a failed copy also sets its job done: check after the wait too
            raise RuntimeError(f"expert copy failed: {self.error!r}") from self.error
        self.device.wait_event(self.device_done.get(key))

    def used(self, slots: list[int]) -> None:
        """The compute that reads these slots has been issued: later copies into them wait for it."""
        ev = self.device.record_event()
        for s in slots:
            self.slot_free[s] = ev

    def _loop(self) -> None:
        self.device.bind_thread("h2d")  # on CUDA: this rank's GPU and its copy stream
        while True:
            with self.cond:
                while not self.heap and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                *rank, _, job = heapq.heappop(self.heap)
                f = job.fetch
                if self.jobs.get(f.key) is not job or tuple(rank) != job.rank():
                    continue  # cancelled, superseded, or re-queued with a new rank
                pairs = job.chunks.pop(0)
            try:
                self.device_done[f.key] = self.device.transfer(pairs, after=self.slot_free.get(f.slot))
                self.copied_bytes += sum(src.numel() * src.element_size() for _, src in pairs)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait()
                self.error = e
                job.chunks = []
            with self.cond:
                if job.chunks and self.jobs.get(f.key) is job:
                    heapq.heappush(self.heap, (*job.rank(), id(job), job))
                    continue
                if self.jobs.get(f.key) is job:
                    del self.jobs[f.key]
            job.done.set()

    def close(self) -> None:
        """Stop after the copy under way has been issued (the caller then synchronizes the device)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
