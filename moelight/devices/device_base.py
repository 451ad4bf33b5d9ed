"""The device layer's interface: memory with a budget, lanes of ordered work, events.

A device offers memory on the accelerator (`empty` from a lane's pool, `record_stream`, `free`,
every tensor on it counted against its capacity), pinned host memory, copies that a copy lane
runs, and `submit(lane, fn, deps)` that runs `fn` on a lane once `deps` allow it.

Lanes (schedule.py's, and the simulator's): "gpu", "h2d", "d2h" are device streams; "cpu" and
"pin" are host threads. A task is *launched* when its function has run on its lane's thread
(for a stream lane: its work is enqueued) and *done* when its work has completed. A stream-lane
task may launch once its stream dependencies are launched (the stream waits for them on the
device, as `wait_event` does on CUDA); anything that depends on a host lane, and every host-lane
task, waits for completion. A failing task marks its event failed; tasks depending on it are
skipped and fail too, and `synchronize` raises the first error, so nothing deadlocks on an error.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

DEVICE_LANES = ("gpu", "cpu", "h2d", "d2h", "pin")
STREAM_LANES = ("gpu", "h2d", "d2h")  # device streams; the other lanes are host threads


JOIN_SECONDS = 120  # a closing worker thread ends the kernel or copy it is in first (minutes on a loaded host)

class DeviceOutOfMemory(RuntimeError):
    """An allocation would exceed the device's memory capacity."""


class DependencyFailed(RuntimeError):
    pass


class StreamOrderError(RuntimeError):
    """Device memory used by a lane in an order CUDA does not guarantee (a race on a real GPU)."""


class Event:
    """One submitted task (host side): launched, then done; CUDA stream tasks add a cuda event.
    `clock` maps each lane to the latest of its tasks this one is ordered after (itself included)."""

    def __init__(self, name: str = "", lane: str = "") -> None:
        self.name, self.lane = name, lane
        self.launched = False
        self.done = False
        self.error: BaseException | None = None
        self.cuda_event = None  # CUDA: recorded after the task's stream work
        self.t_start = 0.0
        self.t_end = 0.0
        self.position = -1  # order among its lane's tasks
        self.clock: dict[str, int] = {}


_current = threading.local()


def current_lane() -> str:
    """The lane the calling thread works for: a lane worker's own, else the compute lane (as the
    current stream of a thread is the default compute stream on CUDA)."""
    return getattr(_current, "lane", "gpu")


def current_event() -> Event | None:
    """The task the calling lane thread is running (None outside a lane task)."""
    return getattr(_current, "event", None)


def bind_current(lane: str, event: Event | None = None) -> None:
    _current.lane, _current.event = lane, event


class Device(ABC):
    """What the executors and the weight pager need from an accelerator."""

    kind: str = "abstract"
    torch_device: torch.device

    # ---- memory ----
    @abstractmethod
    def empty(self, shape, dtype: torch.dtype, tag: str = "", lane: str | None = None) -> torch.Tensor:
        """Device memory from the pool of `lane` (default: the calling thread's), the lane that will
        write it first: a freed block is reused at once by later allocations on that lane."""

    @abstractmethod
    def record_stream(self, t: torch.Tensor, lane: str) -> None:
        """`t` (from another lane's pool) is used by `lane`'s work: its block is not reused before
        the work launched on `lane` up to its release has run (CUDA's Tensor.record_stream)."""

    @abstractmethod
    def free(self, t: torch.Tensor | None) -> None:
        """The caller drops its last use of a device tensor: its memory may be reused at once."""

    @abstractmethod
    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        """An existing tensor that lives on the device from now on (counted against the capacity)."""

    @abstractmethod
    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (copy sources and destinations)."""

    @abstractmethod
    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t` in page-locked host memory (itself if it is already)."""

    @abstractmethod
    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        """Place a module's parameters on the device (counted), returning the module to call."""

    @abstractmethod
    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A small pinned host tensor (token ids, positions, rotary tables) on the device, copied
        on the calling lane without a host sync."""

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
        """dst.copy_(src) on the current lane, asynchronously: dst holds the data once the task is done."""

    @abstractmethod
    def is_complete(self, event: Event | None) -> bool:
        """Whether the work of a submitted task has run (None: nothing to wait for)."""

    @abstractmethod
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A device result on the host, waited for (one host sync: the sampled tokens' logits)."""

    # ---- direct use (the expert cache's copy thread and compute, outside the lanes) ----
    @abstractmethod
    def transfer(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Host -> device copies of (dst, src) pairs as the link does them, from the calling thread,
        once `after` (an event from `record_event`) has passed; returns an event marking their end."""

    def record_event(self):
        """An event at this point of the compute lane (None where compute is synchronous)."""
        return None

    def wait_event(self, event) -> None:  # noqa: B027 - a no-op unless copies complete later
        """Make later compute wait for `event` (a transfer's end) on the device, without a host sync."""
        return None

    def compute(self) -> contextlib.AbstractContextManager:
        """Run this device's compute from the calling thread (the expert cache's passes)."""
        return contextlib.nullcontext()

    def bind_thread(self, lane: str) -> None:
        """Make the calling thread (not a lane worker) work for `lane` on this device."""
        bind_current(lane)

    def counters(self) -> dict[str, int]:
        """Work issued from the compute lane so far: kernel launches and host syncs (where counted)."""
        return {}

    def count_compute(self, enabled: bool) -> None:  # noqa: B027 - devices that always count ignore it
        """Count launches and host syncs of the compute lane from now on (or stop)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all submitted work; raise the first error."""

    @abstractmethod
    def close(self) -> None: ...


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
