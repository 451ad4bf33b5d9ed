"""The CUDA device: a compute stream, an H2D and a D2H copy stream, pinned host memory.

Mirrors the emulated device: the same lane workers pick work ready-first in launch
order. A GPU-stream task is "launched" when its worker has enqueued it and recorded a
cuda event; a dependency counts as ready for a worker when it is on the worker's own
stream and launched (stream order does the rest) or when it has completed (cuda event
query for GPU work, host flag for CPU work). Work whose dependencies are on another
stream therefore never sits in a stream blocking later, ready work, which is what the
simulator assumes. Host lanes ("cpu", "pin") run their function on their thread.

Untested on this project's CPU-only CI; the emulated device runs the same executor code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moelight.devices.device_base import (
    DEVICE_LANES,
    Device,
    DeviceOutOfMemory,
    Event,
    LaneItem,
    LaneSet,
    nbytes_of,
)

_STREAM_LANES = ("gpu", "h2d", "d2h")


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, capacity_bytes: int | None = None, index: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' needs a CUDA build of torch and a GPU; use device='emulated'")
        self.torch_device = torch.device("cuda", index)
        torch.cuda.set_device(self.torch_device)
        free, total = torch.cuda.mem_get_info(self.torch_device)
        self.capacity = int(capacity_bytes if capacity_bytes is not None else free)
        self.base = torch.cuda.memory_allocated(self.torch_device)
        self.streams = {lane: torch.cuda.Stream(self.torch_device) for lane in _STREAM_LANES}
        self._reserved = 0
        self._handles: dict[int, int] = {}
        self._next = 1
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        self.lanes = LaneSet(self._run, self._ready, DEVICE_LANES, poll_s=0.0002)

    # ---- memory ----
    def _check(self, nbytes: int, tag: str) -> None:
        if self.memory_used + nbytes > self.capacity:
            raise DeviceOutOfMemory(
                f"device memory budget exceeded allocating {nbytes} B for {tag or 'tensor'}: "
                f"{self.memory_used} B in use of {self.capacity} B"
            )

    def empty(self, shape, dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self._check(n, tag)
        # owned by the compute stream; copies into it record their own stream (see copy)
        with torch.cuda.stream(self.streams["gpu"]):
            return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        if self.memory_used > self.capacity:
            raise DeviceOutOfMemory(
                f"device memory budget exceeded after {tag or 'a kernel'}: "
                f"{self.memory_used} B of {self.capacity} B"
            )
        return t

    def free(self, t: torch.Tensor | None) -> None:
        return None  # the caching allocator reclaims it once the last reference (and stream use) ends

    def reserve(self, nbytes: int, tag: str) -> int:
        self._check(0, tag)  # the bytes are real allocations already counted by torch
        return 0

    def release(self, handle: int) -> None:
        return None

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        self._check(sum(nbytes_of(p) for p in module.parameters()), tag)
        return module.to(self.torch_device)

    @property
    def memory_used(self) -> int:
        return torch.cuda.memory_allocated(self.torch_device) - self.base

    @property
    def memory_peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.torch_device) - self.base

    @property
    def memory_capacity(self) -> int:
        return self.capacity

    # ---- work ----
    def _ready(self, lane: str, ev: Event) -> bool:
        if not ev.done:
            return False
        if ev.cuda_event is None:
            return True
        return getattr(ev, "lane", None) == lane or ev.cuda_event.query()

    def _run(self, lane: str, item: LaneItem) -> None:
        if lane not in self.streams:
            for d in item.deps:  # host work reads device results: wait for them to complete
                if d.cuda_event is not None:
                    d.cuda_event.synchronize()
            item.fn()
            return
        stream = self.streams[lane]
        with torch.cuda.stream(stream):
            for d in item.deps:
                if d.cuda_event is not None:
                    stream.wait_event(d.cuda_event)
            item.fn()
            ev = torch.cuda.Event()
            ev.record(stream)
        item.event.cuda_event = ev
        item.event.lane = lane  # type: ignore[attr-defined]

    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event] = (), nbytes: float = 0, name: str = ""
    ) -> Event:
        return self.lanes.submit(lane, fn, deps, nbytes, name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        cur = torch.cuda.current_stream(self.torch_device)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(cur)  # keep the caching allocator from reusing it mid-copy
        dst.copy_(src, non_blocking=True)

    def host_wait(self, t: torch.Tensor) -> None:
        torch.cuda.current_stream(self.torch_device).synchronize()

    def transfer(self, pairs, after=None):
        """On the H2D stream, after `after`; pageable sources go through a pinned staging buffer."""
        stream = self.streams["h2d"]
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            for dst, src in pairs:
                if not src.is_pinned():
                    staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                    staged.copy_(src)
                    src = staged  # the host allocator keeps it alive until the copy is done
                dst.record_stream(stream)
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def record_event(self):
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.torch_device))
        return ev

    def wait_event(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.torch_device).wait_event(event)

    def synchronize(self) -> None:
        self.lanes.wait_all()
        torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        self.lanes.close()
