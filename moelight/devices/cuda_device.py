"""The CUDA device: a compute stream, an H2D and a D2H copy stream, pinned host memory.

The same lane workers as the emulated device: a stream-lane task launches once its stream
dependencies are launched, and its stream waits for their cuda events on the GPU (`wait_event`),
never the host; host lanes wait for the device work they read (`Event.synchronize`). Memory is
what the caching allocator holds: the capacity comes from `mem_get_info` less a margin, and
`set_per_process_memory_fraction` makes the allocator itself stop there, so every tensor counts,
kernels' temporaries and cuBLAS workspaces included. Copy destinations are allocated on the
stream that writes them and recorded (`record_stream`) on the stream that reads them. Task times
come from CUDA events (enable_timing), so a measured timeline shows when the GPU ran the work.

This project's CI has no GPU: the emulated device runs the same executor code under the same
rules (ARCHITECTURE.md, "Layers"); tests marked `cuda` run this one where a GPU is present.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import torch

from moelight.devices.compute_counter import ComputeCounts, counting
from moelight.devices.cuda_sanitizer import sanitize_this_thread
from moelight.devices.device_base import (
    DEVICE_LANES,
    STREAM_LANES,
    Device,
    DeviceOutOfMemory,
    Event,
    bind_current,
    current_lane,
    nbytes_of,
)
from moelight.devices.lanes import LaneItem, LaneSet

_MIN_MARGIN = 512 * 2**20  # what the CUDA context, cuBLAS and fragmentation may take beyond the plan


def default_margin(total: int) -> int:
    return max(_MIN_MARGIN, total // 20)


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, capacity_bytes: int | None = None, index: int = 0, margin_bytes: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' needs a CUDA build of torch and a GPU; use device='emulated'")
        self.index = index
        self.torch_device = dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        free, total = torch.cuda.mem_get_info(dev)
        limit = free - (default_margin(total) if margin_bytes is None else margin_bytes)
        if limit <= 0:
            raise DeviceOutOfMemory(f"cuda:{index} has {free} B free of {total} B, less than the margin moelight "
                                    "leaves for the CUDA context and workspaces; free the GPU or pick another one")
        self.capacity = min(int(capacity_bytes), limit) if capacity_bytes else limit
        self.base = torch.cuda.memory_allocated(dev)
        torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(dev) + self.capacity)
                                                       / total), dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.streams = {lane: torch.cuda.Stream(dev) for lane in STREAM_LANES}
        self.counts = ComputeCounts()
        self.pageable_copies = 0
        self._counting_on = False
        self._lock = threading.Lock()
        self._timed: list[tuple[Event, torch.cuda.Event, torch.cuda.Event]] = []
        self._anchor: tuple[float, torch.cuda.Event] | None = None
        self._staging: list[list] = []  # [pinned buffer, its last copy's event]: pageable transfer sources
        sanitize_this_thread()  # under TORCH_CUDA_SANITIZER: its records shared safely with the lane threads
        self.lanes = LaneSet(self._launch, DEVICE_LANES, thread_init=self._init_thread)

    # ---- memory ----
    def _check(self, nbytes: int, tag: str) -> None:
        if self.memory_used + nbytes > self.capacity:
            raise DeviceOutOfMemory(
                f"cuda:{self.index} memory exceeded allocating {nbytes} B for {tag or 'a tensor'}: "
                f"{self.memory_used} B in use of {self.capacity} B")

    def empty(self, shape, dtype: torch.dtype, tag: str = "", lane: str | None = None) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        self._check(n, tag)
        try:  # on the stream that writes it first (copies into it wait for nothing else)
            with torch.cuda.stream(self.streams[lane or current_lane()]):
                return torch.empty(shape, dtype=dtype, device=self.torch_device)
        except torch.OutOfMemoryError as e:
            raise DeviceOutOfMemory(f"cuda:{self.index}: {tag or 'a tensor'} of {n} B: {e}") from e

    def record_stream(self, t: torch.Tensor, lane: str) -> None:
        if t.is_cuda:
            t.record_stream(self.streams[lane])

    def free(self, t: torch.Tensor | None) -> None:
        return None  # the caching allocator reclaims it once the last reference (and recorded use) ends

    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        self._check(0, tag)
        return t

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        self._check(sum(nbytes_of(p) for p in module.parameters() if not p.is_cuda), tag)
        with torch.cuda.stream(self.streams["gpu"]):  # the stream that reads them: no race with its first use
            return module.to(self.torch_device)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_pinned():
            self.pageable_copies += 1
            t = t.pin_memory()  # a pageable source would make the copy wait for the stream
        return t.to(self.torch_device, non_blocking=True)

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
    def _init_thread(self, lane: str) -> None:
        torch.cuda.set_device(self.index)  # a new thread's current device is GPU 0
        bind_current(lane)
        sanitize_this_thread()

    def _counting(self):
        if not self._counting_on:
            return contextlib.nullcontext()
        return counting(self.counts, lambda t: t.is_cuda)

    def _launch(self, lane: str, item: LaneItem) -> None:
        if lane not in self.streams:  # a host lane reads device results: wait for them to complete
            for d in item.deps:
                if d.cuda_event is not None:
                    d.cuda_event.synchronize()
            item.fn()
            return
        stream = self.streams[lane]
        with torch.cuda.stream(stream):
            with self._lock:
                if self._anchor is None:  # the GPU is idle after a synchronize: its clock meets the host's here
                    anchor = torch.cuda.Event(enable_timing=True)
                    anchor.record(stream)
                    self._anchor = (time.perf_counter(), anchor)
            for d in item.deps:
                if d.cuda_event is not None:
                    stream.wait_event(d.cuda_event)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                with self._counting() if lane == "gpu" else contextlib.nullcontext():
                    item.fn()
            except torch.OutOfMemoryError as e:
                raise DeviceOutOfMemory(f"cuda:{self.index} in {item.event.name}: {e}") from e
            end.record(stream)
        item.event.cuda_event = end
        with self._lock:
            self._timed.append((item.event, start, end))

    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event] = (), nbytes: float = 0, name: str = ""
    ) -> Event:
        return self.lanes.submit(lane, fn, deps, nbytes, name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        cur = torch.cuda.current_stream(self.torch_device)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(cur)  # keep the caching allocator from reusing it mid-copy
            elif not t.is_pinned():
                self.pageable_copies += 1
        dst.copy_(src, non_blocking=True)

    def is_complete(self, event: Event | None) -> bool:
        if event is None:
            return True
        return event.cuda_event.query() if event.cuda_event is not None else event.done

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(self.torch_device).synchronize()
        if self._counting_on:
            self.counts.add(sync="to_host")
        return host

    def _staged(self, src: torch.Tensor) -> torch.Tensor:
        """A pageable source through one of two pinned buffers allocated once (grown when needed);
        a buffer is refilled once its last copy has run."""
        n = nbytes_of(src)
        if len(self._staging) < 2 or self._staging[0][0].numel() < n:
            self._staging = [[torch.empty(n, dtype=torch.uint8, pin_memory=True), None] for _ in range(2)]
        slot = self._staging.pop(0)
        if slot[1] is not None:
            slot[1].synchronize()
        view = slot[0][:n].view(src.dtype).view(src.shape)
        view.copy_(src)  # torch's multi-threaded host copy
        self._staging.append(slot)
        return view

    def transfer(self, pairs, after=None):
        """On the H2D stream, after `after`; pinned sources directly, pageable ones staged."""
        stream = self.streams["h2d"]
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            for dst, src in pairs:
                staged = not src.is_pinned()
                if staged:
                    self.pageable_copies += 1
                    src = self._staged(src)
                dst.record_stream(stream)
                dst.copy_(src, non_blocking=True)
                if staged:
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    self._staging[-1][1] = ev
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

    @contextlib.contextmanager
    def compute(self):
        torch.cuda.set_device(self.index)
        bind_current("gpu")
        with torch.cuda.stream(self.streams["gpu"]), self._counting():
            yield

    def bind_thread(self, lane: str) -> None:
        torch.cuda.set_device(self.index)
        torch.cuda.set_stream(self.streams[lane])
        bind_current(lane)
        sanitize_this_thread()

    def counters(self) -> dict[str, int]:
        return self.counts.snapshot() | {"pageable_copies": self.pageable_copies}

    def count_compute(self, enabled: bool) -> None:
        self._counting_on = enabled

    def synchronize(self) -> None:
        try:
            self.lanes.wait_all()
        finally:
            torch.cuda.synchronize(self.torch_device)
            self._resolve_times()

    def _resolve_times(self) -> None:
        """Stream tasks' t_start / t_end from their CUDA events, on the host's clock."""
        with self._lock:
            timed, anchor, self._timed, self._anchor = self._timed, self._anchor, [], None
        if anchor is None:
            return
        host0, ev0 = anchor
        for ev, start, end in timed:
            ev.t_start = host0 + ev0.elapsed_time(start) / 1e3
            ev.t_end = host0 + ev0.elapsed_time(end) / 1e3

    def close(self) -> None:
        self.lanes.close()
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.set_per_process_memory_fraction(1.0, self.torch_device)
