"""Pinned host buffers allocated once per size and reused: the host end of the runtime's copies
(D2H destinations, H2D sources). A buffer given back with an event is handed out again only once
that event's work has run (a copy still reading it would otherwise see the next tenant's data).
Sizes are rounded up to powers of two, so the pool holds a few buffers per size class however the
shapes vary from step to step."""

from __future__ import annotations

import threading

import torch

from moelight.devices.device_base import Device, Event


def size_class(nbytes: int) -> int:
    """The buffer size serving `nbytes`: the next power of two (at least 256 B). Uploads whose size
    follows the batch or the longest context reuse a few buffers instead of one per size seen."""
    return max(256, 1 << max(0, nbytes - 1).bit_length())


class HostBuffers:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.free: dict[int, list[tuple[torch.Tensor, Event | None]]] = {}  # bytes -> (buffer, busy until)
        self.base: dict[int, torch.Tensor] = {}  # storage data_ptr of a handed-out view -> its buffer
        self.allocated = 0  # buffers made (a test checks that steady state makes none)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        size = size_class(n)
        with self.lock:
            ring = self.free.setdefault(size, [])
            k = next((i for i, (_, ev) in enumerate(ring) if self.device.is_complete(ev)), None)
            if k is None:
                buf = self.device.pinned((size,), torch.uint8)
                self.allocated += 1
            else:
                buf = ring.pop(k)[0]
            view = buf[:n].view(dtype).view(shape)
            self.base[view.untyped_storage().data_ptr()] = buf
        return view

    def give(self, t: torch.Tensor, after: Event | None = None) -> None:
        """Back to the pool, free for reuse once `after` (the task whose copy reads or writes it) is done."""
        with self.lock:
            buf = self.base.pop(t.untyped_storage().data_ptr(), None)
            if buf is not None:
                self.free.setdefault(buf.numel(), []).append((buf, after))
