"""The CUDA device on a real GPU (the `cuda` marker: skipped without one): memory from the GPU's free
memory with the allocator capped there, copies ordered by CUDA events on the GPU (not the host),
timings from CUDA events, each lane thread on the device's GPU, the compute lane's syncs counted,
and `moelight profile`'s GPU terms. The emulated device's tests (test_pipeline_device.py) hold the
same rules on every machine; these check that CUDA keeps them."""

from __future__ import annotations

import os

import pytest
import torch

from moelight.devices.device_base import DeviceOutOfMemory
from moelight.devices.registry import create_device

SANITIZED = bool(os.environ.get("TORCH_CUDA_SANITIZER"))  # CSAN checks every kernel's streams, slowly
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def dev():
    d = create_device("cuda")
    yield d
    d.close()


def test_capacity_is_the_free_memory_less_a_margin_and_the_allocator_stops_there(dev):
    free, total = torch.cuda.mem_get_info()
    assert 0 < dev.memory_capacity < free
    with pytest.raises(DeviceOutOfMemory):
        dev.empty((dev.memory_capacity + 2**20,), torch.uint8, "too much")

    def kernel():  # a temporary past the capacity: the capped allocator raises, as DeviceOutOfMemory
        torch.empty(dev.memory_capacity + 2**26, dtype=torch.uint8, device=dev.torch_device).fill_(1)

    dev.submit("gpu", kernel, name="too large a temporary")
    with pytest.raises(DeviceOutOfMemory):
        dev.synchronize()


def test_copy_then_compute_in_gpu_order_with_gpu_timings(dev):
    src = dev.pinned((1 << 24,), torch.float32).fill_(3.0)
    dst = dev.empty((1 << 24,), torch.float32, "dst", lane="h2d")
    dev.record_stream(dst, "gpu")
    box = {}
    up = dev.submit("h2d", lambda: dev.copy(dst, src), name="64 MiB up")
    use = dev.submit("gpu", lambda: box.setdefault("sum", dst.sum()), [up], name="reads it")
    dev.synchronize()
    assert float(box["sum"]) == 3.0 * (1 << 24)
    assert up.t_end > up.t_start and use.t_start >= up.t_end - 1e-4  # from CUDA events: the GPU's order


def test_lane_threads_use_the_devices_gpu_and_compute_syncs_are_counted(dev):
    seen = {}
    dev.submit("gpu", lambda: seen.setdefault("gpu", torch.cuda.current_device()), name="where")
    dev.submit("cpu", lambda: seen.setdefault("cpu", torch.cuda.current_device()), name="where")
    dev.count_compute(True)
    x = torch.ones(4, device=dev.torch_device)
    torch.cuda.synchronize(dev.torch_device)  # written on this thread's stream, read on the compute lane's
    before = dev.counters()["syncs"]
    dev.submit("gpu", lambda: (x * 2).tolist(), name="reads back")
    dev.synchronize()
    dev.count_compute(False)
    assert seen == {"gpu": dev.index, "cpu": dev.index}
    assert dev.counters()["syncs"] - before == 1


def test_a_transfer_is_waited_for_on_the_gpu(dev):
    src = torch.arange(1 << 20, dtype=torch.float32)  # pageable: staged through the pinned ring
    dst = dev.empty((1 << 20,), torch.float32, "slot", lane="h2d")
    done = dev.transfer([(dst, src)])
    with dev.compute():
        dev.wait_event(done)
        total = dst.sum()
    dev.synchronize()  # read on the host's default stream: after the compute stream's sum
    assert float(total) == float(src.sum())


@pytest.mark.skipif(SANITIZED, reason="timings under TORCH_CUDA_SANITIZER measure the sanitizer")
def test_the_gpu_profile_measures_this_gpu():
    from moelight.profiling.machine_profile import measure_gpu

    level, link, count = measure_gpu(quick=True)
    assert count >= 1 and level.memory_bytes > 0 and level.gemm_bandwidth > 0
    assert link.h2d > link.pageable_h2d > 0 and level.layer_overhead_s > 0
