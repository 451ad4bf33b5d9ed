"""The simulator's copy engine: one link, a priority queue of expert copies, timed.

Demand copies go before prefetches, prefetches by priority, ties by issue order. A copy moves in
`chunks` pieces (ProMoE splits an expert into its three matrices): a demand issued while a
prefetch is under way starts after that prefetch's current chunk, not after the whole expert.
A prefetch whose expert turns out to be needed is promoted to demand (ProMoE's early preemption).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from moelight.expert_cache.cache_state import CacheStats, Fetch


@dataclass
class _Job:
    key: int
    demand: bool
    priority: float
    order: int
    issued: float
    chunks_left: int
    version: int = 0

    def rank(self) -> tuple:
        return (0 if self.demand else 1, -self.priority, self.order, self.version)


class LinkQueue:
    def __init__(self, seconds_per_copy: float, bytes_per_copy: float, stats: CacheStats, chunks: int = 1) -> None:
        self.chunks = max(1, chunks)
        self.dt, self.nbytes, self.stats = seconds_per_copy / self.chunks, bytes_per_copy / self.chunks, stats
        self.heap: list[tuple] = []
        self.busy_until = 0.0
        self.done_at: dict[int, float] = {}  # key -> when its latest copy completed
        self.jobs: dict[int, _Job] = {}  # key -> its copy, not finished

    def _push(self, job: _Job) -> None:
        heapq.heappush(self.heap, (*job.rank(), id(job), job))

    def push(self, f: Fetch, t: float) -> None:
        job = _Job(f.key, f.demand, f.priority, f.order, t, self.chunks)
        self.jobs[f.key] = job
        self.done_at.pop(f.key, None)
        self._push(job)

    def promote(self, key: int) -> None:
        """A prefetch still under way whose expert is needed now: its remaining chunks become demand."""
        job = self.jobs.get(key)
        if job is not None and not job.demand:
            job.demand, job.priority, job.version = True, float("inf"), job.version + 1
            self._push(job)

    def cancel(self, key: int) -> bool:
        """Drop the rest of a copy whose expert was evicted; True if none of it had moved."""
        job = self.jobs.pop(key, None)
        return job is not None and job.chunks_left == self.chunks

    def _start_next(self) -> None:
        *rank, _, job = heapq.heappop(self.heap)
        if self.jobs.get(job.key) is not job or tuple(rank) != job.rank():
            return  # cancelled, finished, or re-queued with a new rank
        self.busy_until = max(self.busy_until, job.issued) + self.dt
        self.stats.fetched_bytes += self.nbytes
        job.chunks_left -= 1
        if job.chunks_left:
            self._push(job)
        else:
            del self.jobs[job.key]
            self.done_at[job.key] = self.busy_until

    def run_until(self, t: float) -> None:
        """Start every chunk the engine would start before time t."""
        while self.heap and max(self.busy_until, self.heap[0][-1].issued) < t:
            self._start_next()

    def late(self, key: int, t: float) -> bool:
        """Whether `key`'s copy is still waiting or under way at time t."""
        return key in self.jobs or self.done_at.get(key, 0.0) > t

    def ready_at(self, key: int) -> float:
        """When `key` is on the device (running the queue in order until it is)."""
        while key in self.jobs:
            self._start_next()
        return self.done_at.get(key, 0.0)

    def stream(self, t: float, copies: int, compute: list[float]) -> float:
        """DuoServe's prefill: `copies` experts through two slots of their own, copy i+2 after compute i;
        returns when the last expert's compute ends. The link is busy with them meanwhile."""
        self.run_until(t)
        copy_end, compute_end = [], []
        link = max(self.busy_until, t)
        for i in range(copies):
            start = max(link, compute_end[i - 2] if i >= 2 else t)
            link = start + self.dt * self.chunks
            copy_end.append(link)
            compute_end.append(max(compute_end[-1] if compute_end else t, link) + compute[i])
        self.busy_until = link
        self.stats.fetched_bytes += copies * self.nbytes * self.chunks
        return compute_end[-1] if compute_end else t
