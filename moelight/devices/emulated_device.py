"""An emulated accelerator that behaves like CUDA where CUDA is unforgiving (ARCHITECTURE.md, "Layers"),
so paging, buffers and synchronisation are tested on every machine:

- copies run later, on a copy stream of their own per direction (copy_stream.py), at the link's
  bandwidth, and poison their destination until they have run; a task's event is done only when
  its copies have run;
- memory (emulated_memory.py): every tensor on the device counts against its capacity, the
  compute kernels' temporaries included; per-lane pools reuse a freed block at once and poison it;
- stream order: a block from one lane's pool used by another lane without `record_stream`, or
  first written by another lane that has not waited for the pool's lane, raises StreamOrderError
  (on a GPU it is a race);
- the compute lane counts its kernel launches and host syncs (compute_counter.py).
Tensors stay ordinary CPU tensors: the emulation is about order, time and capacity, not place.
Compute runs on the lane thread as it is issued; a compute task that waits for copies blocks its
lane, as a stream blocked in `wait_event` does.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from moelight.devices import race_check
from moelight.devices.compute_counter import ComputeCounts, counting, stream_order_check, uncounted
from moelight.devices.copy_stream import CopyJob, CopyStream
from moelight.devices.device_base import (
    DEVICE_LANES,
    STREAM_LANES,
    DependencyFailed,
    Device,
    Event,
    StreamOrderError,
    bind_current,
    current_event,
    current_lane,
)
from moelight.devices.emulated_memory import DeviceMemory, poison
from moelight.devices.lanes import LaneItem, LaneSet
from moelight.devices.race_check import RaceCheck

_COPY_LANES = ("h2d", "d2h")


class EmulatedDevice(Device):
    kind = "emulated"

    def __init__(
        self,
        capacity_bytes: int = 1 << 40,
        h2d_bandwidth: float = 16e9,
        d2h_bandwidth: float = 16e9,
        compute_slowdown: float = 1.0,
    ) -> None:
        """compute_slowdown > 1 stretches GPU-lane work (sleeping (s-1) x its run time) to
        mimic a slower accelerator; 1 runs it at this host's speed."""
        self.torch_device = torch.device("cpu")
        self.compute_slowdown = compute_slowdown
        self.counts = ComputeCounts()
        self.pageable_copies = 0  # host -> device copies from pageable memory (synchronous on CUDA)
        self._pinned: dict[int, object] = {}  # storage data_ptr of pinned host buffers
        self._tls = threading.local()
        self.memory = DeviceMemory(capacity_bytes, self._positions)
        self._check_use = stream_order_check(self.memory)
        self.races = RaceCheck(lambda t: self.memory.block_of(t) is not None) if race_check.wanted() else None
        if self.races is not None:
            self.memory.on_new_storage = self.races.forget
        self.lanes = LaneSet(self._launch, DEVICE_LANES, done_on_launch=("gpu", "cpu", "pin"),
                             thread_init=self._init_thread)
        self.lanes.on_complete.append(self.memory.settle)
        bandwidth = {"h2d": h2d_bandwidth, "d2h": d2h_bandwidth}
        self.streams = {lane: CopyStream(lane, bandwidth[lane], self.lanes.wait_done) for lane in _COPY_LANES}

    def _positions(self):
        lanes = getattr(self, "lanes", None)
        return (lanes.position, lanes.done_position) if lanes is not None else ({}, {})

    def _counting(self):
        return counting(self.counts, lambda t: self.memory.block_of(t) is not None, self.memory, self._check_use,
                        None if self.races is None else self.races.kernel)

    def _init_thread(self, lane: str) -> None:
        bind_current(lane)
        if lane == "gpu":  # this thread's kernels are the device's: count them (the stack lives with the thread)
            self._tls.stack = self._counting()

    # ---- memory ----
    def empty(self, shape, dtype: torch.dtype, tag: str = "", lane: str | None = None) -> torch.Tensor:
        return self.memory.empty(shape, dtype, tag, lane or current_lane())

    def record_stream(self, t: torch.Tensor, lane: str) -> None:
        block = self.memory.block_of(t)
        if block is not None:
            block.recorded.add(lane)

    def free(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.memory.release(t)

    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        self.memory.track(t, tag)
        return t

    def _mark_pinned(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        key = s.data_ptr()
        if key not in self._pinned:
            self._pinned[key] = weakref.finalize(s, self._pinned.pop, key, None)
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._pinned

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory: not counted against the device, even when a compute task asks for it."""
        with uncounted():
            return self._mark_pinned(torch.empty(shape, dtype=dtype))

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return self._mark_pinned(t)

    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        for t in (*module.parameters(), *module.buffers()):
            self.memory.track(t, tag)
        return module

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_pinned(t):
            self.counts.add(sync="pageable upload")  # CUDA copies pageable memory synchronously
        return t.clone()

    @property
    def memory_used(self) -> int:
        return self.memory.used

    @property
    def memory_peak(self) -> int:
        return self.memory.peak

    @property
    def memory_capacity(self) -> int:
        return self.memory.capacity

    # ---- work ----
    def _launch(self, lane: str, item: LaneItem) -> None:
        stream_deps = [d for d in item.deps if d.lane in STREAM_LANES]
        if lane in _COPY_LANES:
            job = CopyJob(stream_deps, item.event, item.nbytes, lambda err, ev=item.event: self.lanes.complete(ev, err))
            self._tls.job = job
            try:
                item.fn()
            finally:
                self._tls.job = None
            self.streams[lane].enqueue(job)
            return
        self.lanes.wait_done(stream_deps)  # the stream (or the host) waits for the device work it reads
        failed = next((d.error for d in stream_deps if d.error is not None), None)
        if failed is not None:
            raise DependencyFailed(f"{item.event.name}: a dependency failed ({failed!r})")
        t0 = item.event.t_start = time.perf_counter()  # its work starts once what it waits for is done
        item.fn()
        if lane == "gpu" and self.compute_slowdown > 1:
            time.sleep((self.compute_slowdown - 1) * (time.perf_counter() - t0))

    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event] = (), nbytes: float = 0, name: str = ""
    ) -> Event:
        return self.lanes.submit(lane, fn, deps, nbytes, name)

    def _first_use(self, t: torch.Tensor, lane: str, ev: Event | None) -> None:
        """A device tensor used by a copy on `lane` is recorded for it; a pool block of another lane may
        be used only after `lane` waited for that lane's work queued before the block's allocation."""
        block = self.memory.block_of(t)
        if block is None or block.lane == lane:
            return
        known = ev.clock.get(block.lane, -1) if ev is not None else block.alloc_position
        if block.buffer is not None and known < block.alloc_position:
            raise StreamOrderError(
                f"{ev.name if ev else 'a copy'}: the {lane} lane copies into a block of the {block.lane} "
                f"lane's pool ({block.tag!r}) without waiting for that lane's work queued before the "
                f"allocation: on a GPU the block may still be read by that work; allocate it on the "
                f"{lane} lane")
        block.recorded.add(lane)  # as CUDA's copy records its stream on both tensors

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        job = getattr(self._tls, "job", None)
        if job is None:  # the compute lane's own copy: a kernel, in order
            dst.copy_(src)
            return
        lane, ev = current_lane(), current_event()
        for t in (dst, src):
            self._first_use(t, lane, ev)
        if self.races is not None:
            self.races.access(src, False, "copy")
            self.races.access(dst, True, "copy")
        host = src if lane == "h2d" else dst
        if not self.is_pinned(host):
            self.pageable_copies += 1
        poison(dst)
        job.copies.append((dst, src))

    def is_complete(self, event: Event | None) -> bool:
        return event is None or event.done

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self.counts.add(sync="to_host")
        with uncounted():
            return t.clone()

    def transfer(self, pairs, after=None):
        """Host -> device copies from the calling thread: poisoned until the h2d stream runs them."""
        ev = Event("transfer", "h2d")

        def finish(err, ev=ev) -> None:
            with self.lanes.cond:
                ev.error, ev.launched, ev.done = err, True, True
                self.lanes.cond.notify_all()

        after = after if isinstance(after, Event) else None
        if self.races is not None:
            self.races.transfer(ev, [dst for dst, _ in pairs], after)
        job = CopyJob([after] if after is not None else [], ev, 0.0, finish)
        for dst, src in pairs:
            if not self.is_pinned(src):
                self.pageable_copies += 1
            poison(dst)
            job.copies.append((dst, src))
            job.nbytes += src.numel() * src.element_size()
        self.streams["h2d"].enqueue(job)
        return ev

    def wait_event(self, event) -> None:
        """Compute waits for a transfer: here the compute thread blocks until it has run."""
        if event is None:
            return
        self.lanes.wait_done([event])
        if event.error is not None:
            raise RuntimeError(f"a copy the compute waited for failed: {event.error!r}") from event.error
        if self.races is not None and current_event() is self.races.direct:
            self.races.waited(event.clock)

    def record_event(self):
        """With the race check, a point of the direct compute that copies can be ordered after; else
        None (the emulated compute has run what it issued)."""
        return self.races.record_point() if self.races is not None else None

    @contextlib.contextmanager
    def compute(self):
        before = current_lane(), current_event()
        if self.races is not None:  # CUDA issues it on the compute stream, after that stream's earlier work
            self.races.waited(self.lanes.issued_clock("gpu"))
        bind_current("gpu", self.races.direct if self.races is not None else None)
        try:
            with self._counting():
                yield
        finally:
            bind_current(*before)
            if self.races is not None:  # and before the stream's later work
                self.lanes.order_after("gpu", self.races.direct_clock())

    def counters(self) -> dict[str, int]:
        return self.counts.snapshot() | {"pageable_copies": self.pageable_copies}

    def synchronize(self) -> None:
        self.lanes.wait_all()
        for s in self.streams.values():
            s.drain()
        if self.races is not None:
            self.races.reset()

    def close(self) -> None:
        self.lanes.close()
        for s in self.streams.values():
            s.close()
        self.memory.clear()
