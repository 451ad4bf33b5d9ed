"""Pinned host buffers allocated once per size and reused: the host end of the runtime's copies
(D2H destinations, H2D sources). A buffer given back with an event is handed out again only once
that event's work has run (a copy still reading it would otherwise see the next tenant's data)."""

from __future__ import annotations

import threading

import torch

from moelight.devices.device_base import Device, Event


class HostBuffers:
    def __init__(self, device: Device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.free: dict[int, list[tuple[torch.Tensor, Event | None]]] = {}  # bytes -> (buffer, busy until)
        self.base: dict[int, torch.Tensor] = {}  # storage data_ptr of a handed-out view -> its buffer
        self.allocated = 0  # buffers made (a test checks that steady state makes none)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        with self.lock:
            ring = self.free.setdefault(n, [])
            k = next((i for i, (_, ev) in enumerate(ring) if self.device.is_complete(ev)), None)
            if k is None:
                buf = self.device.pinned((max(n, 1),), torch.uint8)
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
                self.free.setdefault(t.numel() * t.element_size(), []).append((buf, after))
