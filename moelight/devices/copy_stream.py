"""An emulated copy engine: the copies a lane task (or a transfer) issues run later, in order, on
a worker of their own, each job after the events it waits for, taking at least bytes / bandwidth
of wall-clock time, its data landing at the end. Until a job has run, its destinations hold poison
(emulated_memory.poison)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelight.devices.device_base import JOIN_SECONDS, Event


@dataclass
class CopyJob:
    waits: list[Event]
    event: Event
    nbytes: float
    finish: Callable[[BaseException | None], None]
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class CopyStream:
    """One direction of the link: a FIFO of copy jobs and the thread that runs them."""

    def __init__(self, lane: str, bandwidth: float, wait_done: Callable[[list[Event]], None]) -> None:
        self.lane, self.bandwidth, self.wait_done = lane, float(bandwidth), wait_done
        self.jobs: queue.Queue[CopyJob | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"moelight-{lane}-stream", daemon=True)
        self.thread.start()

    def enqueue(self, job: CopyJob) -> None:
        self.jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                self.jobs.task_done()
                return
            err = None
            try:
                self.wait_done(job.waits)
                failed = next((w.error for w in job.waits if w.error is not None), None)
                if failed is not None:
                    raise RuntimeError(f"{job.event.name}: a copy waited for work that failed ({failed!r})")
                job.event.t_start = time.perf_counter()
                if job.nbytes > 0:  # the data lands when the link has moved it, not before
                    time.sleep(job.nbytes / self.bandwidth)
                with torch.inference_mode():  # the launcher's tensors may be inference tensors
                    for dst, src in job.copies:
                        dst.copy_(src)
                job.event.t_end = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - reported through the job's event
                err = e
            job.finish(err)
            self.jobs.task_done()

    def drain(self) -> None:
        """Wait until every job enqueued so far has run."""
        self.jobs.join()

    def close(self) -> None:
        """Copies still queued (a failed job's) are failed, not run: the worker finishes the one it is
        in and stops, so it is not inside a copy when the process exits."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.finish(RuntimeError(f"{job.event.name}: the device closed before the copy ran"))
            self.jobs.task_done()
        self.jobs.put(None)
        self.thread.join(timeout=JOIN_SECONDS)
