"""Device tensors shared between tasks of a graph, freed when their last consumer is done."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from moelight.devices.device_base import Device


def in_inference_mode(fn: Callable[[], None]) -> Callable[[], None]:
    """Lane threads do not inherit the launcher's inference mode."""

    def run() -> None:
        with torch.inference_mode():
            fn()

    return run


class HeldTensors:
    """Device tensors with a count of consumers still to read them; freed at zero."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.items: dict[tuple, list] = {}
        self.lock = threading.Lock()  # consumers on different lanes finish concurrently

    def put(self, key: tuple, users: int, *tensors: torch.Tensor) -> None:
        entry = [users, list(tensors)]
        with self.lock:
            self.items[key] = entry

    def get(self, key: tuple) -> list[torch.Tensor]:
        with self.lock:
            return self.items[key][1]

    def done(self, key: tuple) -> None:
        with self.lock:
            entry = self.items[key]
            entry[0] -= 1
            if entry[0] > 0:
                return
            del self.items[key]
        for t in entry[1]:
            self.device.free(t)
