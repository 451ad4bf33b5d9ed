"""The device layer's small interface, and the lane workers both implementations share.

A device offers: memory on the accelerator (`empty`, `adopt`, `free`, with a budget),
pinned host memory, copies that a copy lane runs, and `submit(lane, fn, deps)` that runs
`fn` on a lane once the events `deps` allow it and returns the task's Event.

Lane semantics are those of schedule.py (and of the simulator): one worker per lane,
serial; among the submitted items whose dependencies are ready, the first submitted
runs. A failing task marks its event failed; tasks depending on it are skipped and
fail too, and `synchronize` raises the first error, so nothing deadlocks on an error.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

DEVICE_LANES = ("gpu", "cpu", "h2d", "d2h", "pin")


class DeviceOutOfMemory(RuntimeError):
    """An allocation would exceed the device-memory budget the plan allows."""


class DependencyFailed(RuntimeError):
    pass


class Event:
    """Completion of one submitted task (host side). CUDA lanes add a cuda event."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.done = False
        self.error: BaseException | None = None
        self.cuda_event = None  # set by the CUDA device for GPU-stream work
        self.t_start = 0.0
        self.t_end = 0.0


@dataclass
class LaneItem:
    seq: int
    fn: Callable[[], None]
    deps: tuple[Event, ...]
    event: Event
    nbytes: float


@dataclass
class LaneSet:
    """Worker threads, one per lane, sharing one condition variable for readiness."""

    run_item: Callable[[str, LaneItem], None]
    is_ready: Callable[[str, Event], bool]
    lanes: Sequence[str] = DEVICE_LANES
    poll_s: float = 0.0005  # CUDA events cannot notify the condition: poll while waiting on them
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.queues: dict[str, list[LaneItem]] = {lane: [] for lane in self.lanes}
        self.pending = 0
        self.seq = 0
        self.first_error: BaseException | None = None
        self.stopping = False
        self.threads = [
            threading.Thread(target=self._loop, args=(lane,), name=f"moelight-{lane}", daemon=True)
            for lane in self.lanes
        ]
        for t in self.threads:
            t.start()

    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event], nbytes: float, name: str
    ) -> Event:
        if lane not in self.queues:
            raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(self.lanes)}")
        ev = Event(name)
        with self.cond:
            self.queues[lane].append(LaneItem(self.seq, fn, tuple(deps), ev, nbytes))
            self.seq += 1
            self.pending += 1
            self.cond.notify_all()
        return ev

    def _pick(self, lane: str) -> LaneItem | None:
        for k, it in enumerate(self.queues[lane]):
            if all(d.error is not None or self.is_ready(lane, d) for d in it.deps):
                return self.queues[lane].pop(k)
        return None

    def _loop(self, lane: str) -> None:
        while True:
            with self.cond:
                item = self._pick(lane)
                while item is None:
                    if self.stopping:
                        return
                    self.cond.wait(timeout=self.poll_s if self.queues[lane] else 0.05)
                    item = self._pick(lane)
            err = next((d.error for d in item.deps if d.error is not None), None)
            item.event.t_start = time.perf_counter()
            if err is None:
                try:
                    self.run_item(lane, item)
                except BaseException as e:  # noqa: BLE001 - reported through synchronize()
                    err = e
            else:
                err = DependencyFailed(f"{item.event.name}: a dependency failed ({err!r})")
            item.event.t_end = time.perf_counter()
            with self.cond:
                item.event.error = err
                item.event.done = True
                if err is not None and self.first_error is None:
                    self.first_error = err
                self.pending -= 1
                self.cond.notify_all()

    def wait_all(self) -> None:
        """Block until every submitted item ran; raise the first error, if any."""
        with self.cond:
            while self.pending:
                self.cond.wait(timeout=0.05)
            err, self.first_error = self.first_error, None
        if err is not None:
            raise err

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self.threads:
            t.join(timeout=5)


class Device(ABC):
    """What the executor and the weight pager need from an accelerator."""

    kind: str = "abstract"
    torch_device: torch.device

    # ---- memory ----
    @abstractmethod
    def empty(self, shape, dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        """Device memory counted against the budget (raises DeviceOutOfMemory)."""

    @abstractmethod
    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        """Count a tensor produced on the device by compute (an activation) against the budget."""

    @abstractmethod
    def free(self, t: torch.Tensor | None) -> None:
        """Give a tensor from `empty` / `adopt` back (no-op for None / unknown tensors)."""

    @abstractmethod
    def reserve(self, nbytes: int, tag: str) -> int:
        """Count bytes held by something else (e.g. modules moved to the device); returns a handle."""

    @abstractmethod
    def release(self, handle: int) -> None: ...

    @abstractmethod
    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (the staging buffers of the weight pager)."""

    @abstractmethod
    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        """Place a module's parameters on the device (counted), returning the module to call."""

    @property
    @abstractmethod
    def memory_used(self) -> int: ...

    @property
    @abstractmethod
    def memory_peak(self) -> int: ...

    @property
    @abstractmethod
    def memory_capacity(self) -> int: ...

    # ---- work ----
    @abstractmethod
    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event] = (), nbytes: float = 0, name: str = ""
    ) -> Event:
        """Run fn on `lane` after deps. Copy lanes call `copy` inside fn."""

    @abstractmethod
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) as the current copy lane does it (non_blocking on CUDA)."""

    @abstractmethod
    def host_wait(self, t: torch.Tensor) -> None:
        """Make a device result safe to read on the host thread (no-op when emulated)."""

    # ---- direct use (the expert cache's copy thread and compute, outside the lanes) ----
    @abstractmethod
    def transfer(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Host -> device copies of (dst, src) pairs as the link does them, from the calling thread,
        once `after` (an event from `record_event`) has passed; returns an event marking their end."""

    def record_event(self):
        """An event at this point of the compute stream (None where compute is synchronous)."""
        return None

    def wait_event(self, event) -> None:  # noqa: B027 - a no-op unless compute is asynchronous
        """Make later compute wait for `event` (a no-op where copies complete before returning)."""
        return None

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all submitted work; raise the first error."""

    @abstractmethod
    def close(self) -> None: ...


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
