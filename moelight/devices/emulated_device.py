"""An emulated accelerator, so paging, buffers and synchronisation run on every machine.

- memory: an arena with a hard capacity; an allocation past it raises DeviceOutOfMemory,
  and the peak is tracked (tests assert peak <= budget);
- copies: one thread per direction (h2d, d2h), serial within a direction, each copy
  taking at least bytes / bandwidth of wall-clock time (it sleeps the rest), so the
  overlap of transfers with compute is real and measurable;
- compute: a worker thread runs the GPU lane's work in order; CPU attention and the
  pinned-staging memcpy have their own threads, as on a real host.
Tensors stay ordinary CPU tensors: the emulation is about time and capacity, not place.
"""

from __future__ import annotations

import threading
import time
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


class Arena:
    """Byte accounting with a hard cap; thread safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._next = 1
        self._live: dict[int, tuple[int, str]] = {}

    def alloc(self, nbytes: int, tag: str = "") -> int:
        with self._lock:
            if self.used + nbytes > self.capacity:
                raise DeviceOutOfMemory(
                    f"device memory budget exceeded allocating {nbytes} B for {tag or 'tensor'}: "
                    f"{self.used} B in use of {self.capacity} B"
                )
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            h = self._next
            self._next += 1
            self._live[h] = (nbytes, tag)
            return h

    def free(self, handle: int) -> None:
        with self._lock:
            nbytes, _ = self._live.pop(handle)
            self.used -= nbytes

    def by_tag(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for n, tag in self._live.values():
                out[tag] = out.get(tag, 0) + n
        return out


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
        self.arena = Arena(capacity_bytes)
        self.bandwidth = {"h2d": float(h2d_bandwidth), "d2h": float(d2h_bandwidth)}
        self.compute_slowdown = compute_slowdown
        self._handles: dict[int, int] = {}  # id(tensor) -> arena handle
        self._tensors: dict[int, torch.Tensor] = {}  # keep ids valid while counted
        self._lock = threading.Lock()
        self.lanes = LaneSet(self._run, lambda lane, ev: ev.done, DEVICE_LANES, poll_s=0.05)

    # ---- memory ----
    def _count(self, t: torch.Tensor, tag: str) -> torch.Tensor:
        h = self.arena.alloc(nbytes_of(t), tag)
        with self._lock:
            self._handles[id(t)] = h
            self._tensors[id(t)] = t
        return t

    def empty(self, shape, dtype: torch.dtype, tag: str = "") -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        h = self.arena.alloc(n, tag)  # check before allocating host memory
        t = torch.empty(shape, dtype=dtype)
        with self._lock:
            self._handles[id(t)] = h
            self._tensors[id(t)] = t
        return t

    def adopt(self, t: torch.Tensor, tag: str = "") -> torch.Tensor:
        return self._count(t, tag)

    def free(self, t: torch.Tensor | None) -> None:
        if t is None:
            return
        with self._lock:
            h = self._handles.pop(id(t), None)
            self._tensors.pop(id(t), None)
        if h is not None:
            self.arena.free(h)

    def reserve(self, nbytes: int, tag: str) -> int:
        return self.arena.alloc(int(nbytes), tag)

    def release(self, handle: int) -> None:
        self.arena.free(handle)

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def to_device_module(self, module: torch.nn.Module, tag: str) -> torch.nn.Module:
        self.reserve(sum(nbytes_of(p) for p in module.parameters()), tag)
        return module

    @property
    def memory_used(self) -> int:
        return self.arena.used

    @property
    def memory_peak(self) -> int:
        return self.arena.peak

    @property
    def memory_capacity(self) -> int:
        return self.arena.capacity

    # ---- work ----
    def _run(self, lane: str, item: LaneItem) -> None:
        t0 = time.perf_counter()
        item.fn()
        if lane in self.bandwidth:
            rest = item.nbytes / self.bandwidth[lane] - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        elif lane == "gpu" and self.compute_slowdown > 1:
            time.sleep((self.compute_slowdown - 1) * (time.perf_counter() - t0))

    def submit(
        self, lane: str, fn: Callable[[], None], deps: Sequence[Event] = (), nbytes: float = 0, name: str = ""
    ) -> Event:
        return self.lanes.submit(lane, fn, deps, nbytes, name)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def host_wait(self, t: torch.Tensor) -> None:
        return None

    def transfer(self, pairs, after=None):
        """Copy now, then take the rest of bytes / h2d bandwidth (compute here is synchronous)."""
        t0, nbytes = time.perf_counter(), 0
        for dst, src in pairs:
            dst.copy_(src)
            nbytes += nbytes_of(src)
        rest = nbytes / self.bandwidth["h2d"] - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return None

    def synchronize(self) -> None:
        self.lanes.wait_all()

    def close(self) -> None:
        self.lanes.close()
