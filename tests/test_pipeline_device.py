"""The emulated accelerator, as strict as CUDA: deferred copies that poison their destination until
they run, events done only when their work ran, per-lane pools that reuse a freed block at once,
every tensor on the device (kernels' temporaries included) counted against its capacity, lanes
ready-first, errors propagated, and the stream-order rules CUDA's allocator relies on."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moelight.devices.device_base import DependencyFailed, DeviceOutOfMemory, StreamOrderError
from moelight.devices.registry import create_device


@pytest.fixture
def dev():
    d = create_device("emulated", capacity_bytes=1 << 20, h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    yield d
    d.close()


def test_every_tensor_on_the_device_counts_kernels_temporaries_included(dev):
    weights = torch.nn.Linear(64, 64)
    dev.to_device_module(weights, "w")
    assert dev.memory_used == 4 * (64 * 64 + 64)
    x = dev.empty((8, 64), torch.float32, "x")
    static = dev.memory_used
    seen = {}

    def kernel():  # a temporary of 1 MiB on the compute lane: more than the capacity left
        seen["before"] = dev.memory_used
        torch.ones(1 << 18) * 2  # noqa: B018 - the temporary is the point

    dev.submit("gpu", kernel, name="big temporary")
    with pytest.raises(DeviceOutOfMemory, match="temporaries included"):
        dev.synchronize()
    small = dev.submit("gpu", lambda: (weights(x) * 2).sum(), name="small")
    dev.synchronize()
    assert small.done and dev.memory_peak > static  # its outputs were counted, then released
    assert dev.memory_used == static and seen["before"] == static


def test_a_freed_block_is_reused_at_once_by_its_lane_and_poisoned(dev):
    a = dev.empty((16,), torch.float32, "a", lane="h2d")
    a.fill_(7.0)
    dev.free(a)
    b = dev.empty((16,), torch.float32, "b", lane="h2d")
    assert b.data_ptr() == a.data_ptr() and torch.isnan(a).all()  # a late reader of `a` sees NaN
    c = dev.empty((16,), torch.float32, "c", lane="gpu")  # another lane's pool: another block
    assert c.data_ptr() != b.data_ptr()


def test_a_block_recorded_for_another_lane_waits_for_that_lanes_work(dev):
    gate = threading.Event()
    a = dev.empty((16,), torch.float32, "a", lane="h2d")
    dev.record_stream(a, "gpu")
    started = threading.Event()

    def reader():
        started.set()
        gate.wait(5)

    dev.submit("gpu", reader, name="reads a")
    started.wait(5)
    dev.free(a)  # released while the gpu lane's work that reads it has not finished
    b = dev.empty((16,), torch.float32, "b", lane="h2d")
    assert b.data_ptr() != a.data_ptr()
    gate.set()
    dev.synchronize()
    dev.free(b)
    assert dev.empty((16,), torch.float32, "c", lane="h2d").data_ptr() in (a.data_ptr(), b.data_ptr())


def test_copies_run_later_and_poison_their_destination_until_they_have():
    dev = create_device("emulated", h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    try:
        src, dst = dev.pinned((16,), torch.float32).fill_(3.0), dev.empty((16,), torch.float32, "dst", lane="h2d")
        dev.record_stream(dst, "gpu")
        seen = {}
        ahead = dev.submit("h2d", lambda: None, nbytes=300e6, name="ahead")  # 0.3 s on the link first
        up = dev.submit("h2d", lambda: dev.copy(dst, src), nbytes=40e6, name="up")  # then 40 ms
        after = dev.submit("gpu", lambda: seen.setdefault("after", dst.clone()), [up], name="reads after")
        while not up.launched:
            time.sleep(0.001)
        assert not ahead.done and not up.done and torch.isnan(dst).all()  # launched, not run: poison
        dev.synchronize()
        assert up.done and up.t_end - up.t_start >= 0.04 and torch.equal(seen["after"], src)
        assert after.t_start >= up.t_end  # the compute lane waited for the copy's completion
    finally:
        dev.close()


def test_copies_take_bytes_over_bandwidth_and_directions_overlap():
    dev = create_device("emulated", h2d_bandwidth=1e9, d2h_bandwidth=1e9)
    try:
        up = dev.submit("h2d", lambda: None, nbytes=80e6, name="up")  # 80 ms
        down = dev.submit("d2h", lambda: None, nbytes=80e6, name="down")
        up2 = dev.submit("h2d", lambda: None, nbytes=40e6, name="up2")
        dev.synchronize()
        assert up.t_end - up.t_start >= 0.08
        assert down.t_start < up.t_end and up.t_start < down.t_end  # opposite directions at once
        assert up2.t_start >= up.t_end  # one direction is serial
    finally:
        dev.close()


def test_a_transfer_is_read_safely_only_after_wait_event():
    """The expert cache's copies: compute that does not wait for the copy's event reads poison."""
    dev = create_device("emulated", h2d_bandwidth=4e6)  # 4 KiB take 1 ms; this one 16 ms
    try:
        src = dev.pin(torch.arange(16384, dtype=torch.float32))
        dst = dev.empty((16384,), torch.float32, "slot", lane="h2d")
        done = dev.transfer([(dst, src)])
        early = dst.clone()  # no wait_event: the copy has not run
        dev.wait_event(done)
        assert torch.isnan(early).all() and torch.equal(dst, src)
    finally:
        dev.close()


def test_a_copy_into_a_block_of_the_compute_lanes_pool_is_a_race():
    """CUDA's empty() on the compute stream, filled by the copy stream: the block may still be read
    by compute queued before the allocation (the old pipeline executor's pairing)."""
    dev = create_device("emulated")
    try:
        src = dev.pinned((8,), torch.float32).fill_(1.0)
        dev.submit("gpu", lambda: None, name="queued compute")
        dev.synchronize()

        def old_pairing():
            dev.copy(dev.empty((8,), torch.float32, "attn", lane="gpu"), src)

        dev.submit("h2d", old_pairing, name="attn copy")
        with pytest.raises(StreamOrderError, match="allocate it on the h2d lane"):
            dev.synchronize()
        box = {}
        up = dev.submit("h2d", lambda: box.setdefault("t", dev.empty((8,), torch.float32, "attn")), name="alloc")
        dev.submit("h2d", lambda: dev.copy(box["t"], src), [up], name="own lane")
        dev.synchronize()  # allocated on the writing lane: fine
    finally:
        dev.close()


def test_compute_reading_another_lanes_block_needs_record_stream():
    dev = create_device("emulated")
    try:
        a = dev.empty((8,), torch.float32, "attn", lane="h2d").fill_(2.0)
        dev.submit("gpu", lambda: a * 2, name="no record_stream")
        with pytest.raises(StreamOrderError, match="without record_stream"):
            dev.synchronize()
        dev.record_stream(a, "gpu")
        dev.submit("gpu", lambda: a * 2, name="recorded")
        dev.synchronize()
    finally:
        dev.close()


def test_compute_lane_counts_launches_and_host_syncs(dev):
    x = dev.empty((4,), torch.float32, "x", lane="gpu").fill_(1.0)

    def work():
        y = x * 2 + 1  # two kernels
        y.view(2, 2)  # a view: no kernel
        y.tolist()  # reads the device on the host: a sync
        torch.nonzero(y)  # data-dependent size: a sync

    before = dev.counters()
    dev.submit("gpu", work, name="work")
    dev.synchronize()
    after = dev.counters()
    assert after["syncs"] - before["syncs"] == 2
    assert after["launches"] - before["launches"] == 3
    host = torch.ones(4)
    dev.submit("gpu", lambda: host.tolist(), name="host data")  # a host tensor: no sync
    dev.synchronize()
    assert dev.counters()["syncs"] == after["syncs"]


def test_lane_runs_ready_work_before_blocked_work(dev):
    gate = threading.Event()
    order = []
    blocker = dev.submit("cpu", lambda: gate.wait(5), name="blocker")
    dev.submit("gpu", lambda: order.append("waits"), [blocker], name="waits")
    dev.submit("gpu", lambda: order.append("ready"), name="ready")
    deadline = time.monotonic() + 10
    while not order and time.monotonic() < deadline:
        time.sleep(0.001)
    gate.set()
    dev.synchronize()
    assert order == ["ready", "waits"]


def test_errors_propagate_to_dependents_and_synchronize(dev):
    ran = []

    def boom():
        raise ValueError("kernel failed")

    bad = dev.submit("gpu", boom, name="bad")
    after = dev.submit("h2d", lambda: ran.append(1), [bad], name="after")
    with pytest.raises(ValueError, match="kernel failed"):
        dev.synchronize()
    assert not ran and isinstance(after.error, DependencyFailed)


def test_unknown_device_kind():
    with pytest.raises(ValueError, match="emulated, cuda"):
        create_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="emulated"):
            create_device("cuda")


@pytest.mark.parametrize("ordered", [True, False])
def test_a_read_back_not_ordered_after_the_kernel_that_wrote_is_a_race(monkeypatch, ordered):
    """The sanitizer's rule, independent of timing: the D2H copy runs after the kernel here (the
    compute lane runs kernels when issued), but only a dependency orders them on a GPU."""
    monkeypatch.setenv("MOELIGHT_EMULATED_RACE_CHECK", "1")
    dev = create_device("emulated")
    try:
        t = dev.empty((4,), torch.float32, "x", lane="gpu")
        host = dev.pinned((4,), torch.float32)
        write = dev.submit("gpu", lambda: t.fill_(1.0), name="write")
        dev.lanes.wait_done([write])
        dev.submit("d2h", lambda: dev.copy(host, t), [write] if ordered else [], name="read back")
        if ordered:
            dev.synchronize()
        else:
            with pytest.raises(StreamOrderError, match="read back .* not ordered after"):
                dev.synchronize()
    finally:
        dev.close()


@pytest.mark.parametrize("ordered", [True, False])
def test_a_copy_over_memory_a_queued_kernel_reads_is_a_race(monkeypatch, ordered):
    """Write after read: the next layer's weights copied into the slot the last kernel read, before
    that kernel is ordered before the copy (on a GPU it may not have run yet)."""
    monkeypatch.setenv("MOELIGHT_EMULATED_RACE_CHECK", "1")
    dev = create_device("emulated")
    try:
        slot = dev.empty((4,), torch.float32, "slot", lane="h2d")
        dev.record_stream(slot, "gpu")
        src = dev.pinned((4,), torch.float32).fill_(1.0)
        first = dev.submit("h2d", lambda: dev.copy(slot, src), name="load")
        read = dev.submit("gpu", lambda: slot * 2, [first], name="use")
        dev.lanes.wait_done([read])
        dev.submit("h2d", lambda: dev.copy(slot, src), [read] if ordered else [], name="next load")
        if ordered:
            dev.synchronize()
        else:
            with pytest.raises(StreamOrderError, match="next load .* writes .* use"):
                dev.synchronize()
    finally:
        dev.close()
