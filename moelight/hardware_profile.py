"""Measure this machine's HRM numbers with torch (`moelight profile`).

Peaks are measured, not looked up: CPU read bandwidth, CPU matmul FLOP/s per dtype and,
with CUDA, GPU bandwidth, GPU matmul FLOP/s per dtype and pinned H2D / D2H bandwidth.
The result is an hrm.HardwareSpec (hrm itself never imports torch); it is cached as
JSON and loaded with `--hardware profile`.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

from hrm.hardware import HardwareSpec, Level, Link


def _best_time(fn: Callable[[], None], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()  # warm up (allocations, kernel selection, JIT)
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _cpu_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * 2**30


def measure_cpu(quick: bool = False) -> Level:
    """CPU read bandwidth (sum over a large float32 buffer) and matmul FLOP/s."""
    import torch

    n_bytes = (64 if quick else 512) * 2**20
    buf = torch.ones(n_bytes // 4, dtype=torch.float32)
    bw = n_bytes / _best_time(lambda: buf.sum(), 3 if quick else 5)
    flops = {}
    size = 512 if quick else 1024
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(size, size).to(dt)
        b = torch.randn(size, size).to(dt)
        flops[name] = 2.0 * size**3 / _best_time(lambda a=a, b=b: torch.mm(a, b), 2 if quick else 4)
    flops["float16"] = flops["bfloat16"]  # CPU half kernels run at about the bf16 rate
    return Level(f"cpu-{os.cpu_count()}c-{platform.machine()}", _cpu_memory_bytes(), bw, flops)


def measure_gpu(quick: bool = False) -> tuple[Level, Link, int] | None:
    """GPU 0: device-to-device copy bandwidth, matmul FLOP/s, pinned H2D / D2H; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda:0")
    sync = torch.cuda.synchronize
    props = torch.cuda.get_device_properties(dev)
    n_bytes = (128 if quick else 1024) * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2.0 * n_bytes / _best_time(lambda: dst.copy_(src), 5, sync)  # read + write
    flops = {}
    size = 2048 if quick else 8192
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        a = torch.randn(size, size, device=dev, dtype=dt)
        b = torch.randn(size, size, device=dev, dtype=dt)
        flops[name] = 2.0 * size**3 / _best_time(lambda a=a, b=b: torch.mm(a, b), 5, sync)
    host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    h2d = n_bytes / _best_time(lambda: src.copy_(host, non_blocking=True), 5, sync)
    d2h = n_bytes / _best_time(lambda: host.copy_(src, non_blocking=True), 5, sync)
    return Level(props.name, float(props.total_memory), bw, flops), Link(h2d, d2h), torch.cuda.device_count()


def profile_machine(quick: bool = False) -> HardwareSpec:
    """Measure CPU (and GPUs when CUDA is present) into a HardwareSpec."""
    cpu = measure_cpu(quick)
    gpu = measure_gpu(quick)
    if gpu is None:
        return HardwareSpec("profiled", cpu, notes="measured by moelight profile (no CUDA)")
    level, link, count = gpu
    return HardwareSpec("profiled", cpu, level, count, link,
                        notes="measured by moelight profile; GPU numbers from cuda:0, assumed identical")
