"""The emulated accelerator: budgeted arena, bandwidth-limited copy lanes, ready-first lanes."""

from __future__ import annotations

import threading

import pytest
import torch

from moelight.devices.device_base import DependencyFailed, DeviceOutOfMemory
from moelight.devices.emulated_device import Arena
from moelight.devices.registry import create_device


def test_arena_enforces_capacity_and_tracks_peak():
    a = Arena(1000)
    h1 = a.alloc(600, "w")
    with pytest.raises(DeviceOutOfMemory, match="budget"):
        a.alloc(500, "x")
    h2 = a.alloc(400, "x")
    a.free(h1)
    a.free(h2)
    assert a.used == 0 and a.peak == 1000


def test_device_tensors_count_against_the_budget():
    dev = create_device("emulated", capacity_bytes=4096)
    try:
        t = dev.empty((512,), torch.float32)  # 2048 B
        with pytest.raises(DeviceOutOfMemory):
            dev.empty((600,), torch.float32)
        dev.free(t)
        u = dev.adopt(torch.zeros(1024), "act")  # 4096 B: fits once t is gone
        assert dev.memory_used == 4096
        dev.free(u)
        assert dev.memory_used == 0 and dev.memory_peak == 4096
    finally:
        dev.close()


def test_copies_take_bytes_over_bandwidth_and_directions_overlap():
    dev = create_device("emulated", h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    try:
        src, dst = torch.ones(16), torch.empty(16)
        up = dev.submit("h2d", lambda: dev.copy(dst, src), nbytes=80e6, name="up")  # 80 ms
        down = dev.submit("d2h", lambda: None, nbytes=80e6, name="down")
        up2 = dev.submit("h2d", lambda: None, nbytes=40e6, name="up2")
        dev.synchronize()
        assert up.t_end - up.t_start >= 0.08 and torch.equal(dst, src)
        assert down.t_start < up.t_end and up.t_start < down.t_end  # opposite directions at once
        assert up2.t_start >= up.t_end  # one direction is serial
    finally:
        dev.close()


def test_lane_runs_ready_work_before_blocked_work():
    dev = create_device("emulated")
    gate = threading.Event()
    order = []
    try:
        blocker = dev.submit("cpu", lambda: gate.wait(5), name="blocker")
        dev.submit("gpu", lambda: order.append("waits"), [blocker], name="waits")
        dev.submit("gpu", lambda: order.append("ready"), name="ready")
        while not order:
            pass
        gate.set()
        dev.synchronize()
        assert order == ["ready", "waits"]
    finally:
        dev.close()


def test_errors_propagate_to_dependents_and_synchronize():
    dev = create_device("emulated")
    ran = []
    try:

        def boom():
            raise ValueError("kernel failed")

        bad = dev.submit("gpu", boom, name="bad")
        after = dev.submit("h2d", lambda: ran.append(1), [bad], name="after")
        with pytest.raises(ValueError, match="kernel failed"):
            dev.synchronize()
        assert not ran and isinstance(after.error, DependencyFailed)
    finally:
        dev.close()


def test_unknown_device_kind():
    with pytest.raises(ValueError, match="emulated, cuda"):
        create_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="emulated"):
            create_device("cuda")
