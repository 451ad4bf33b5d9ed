"""Devices by name: the registry resolves a kind to its class without the base importing it.

Adding a device: a module with a `Device` subclass (device_base.py) and a line in DEVICES.
"""

from __future__ import annotations

import importlib

from moelight.devices.device_base import Device

DEVICES = {
    "emulated": "moelight.devices.emulated_device:EmulatedDevice",  # any machine: a bounded arena and lanes
    "cuda": "moelight.devices.cuda_device:CudaDevice",  # torch.cuda streams and events
}


def create_device(kind: str = "emulated", **kwargs) -> Device:
    """A device of `kind` ("emulated" or "cuda"), built with its own keyword arguments."""
    if kind not in DEVICES:
        raise ValueError(f"unknown device {kind!r}; valid: {', '.join(DEVICES)}")
    module, _, cls = DEVICES[kind].partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
