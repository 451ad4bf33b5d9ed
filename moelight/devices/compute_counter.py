"""Counting what the compute lane issues: kernel launches and host syncs (and, on the emulated
device, every tensor its kernels allocate, which then counts against the device's memory).

A `TorchDispatchMode` sees every aten op the compute thread runs (each non-view op is one kernel
launch on a GPU; ops whose output size depends on the data, such as nonzero or bincount, make the
host wait for the GPU, and so does torch._grouped_mm where it runs its fallback); a
`TorchFunctionMode` sees the Python calls that read a device tensor on the host (tolist, item,
numpy, cpu, bool()). Both are thread-local: only the thread they are entered on is counted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import ExitStack

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from moelight.devices.device_base import StreamOrderError, current_event, current_lane
from moelight.models.grouped_experts import grouped_mm_fast_on

_aten = torch.ops.aten
# no kernel: allocations, metadata, aliases
_NOT_LAUNCHES = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
                 _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default,
                 _aten._local_scalar_dense.default, _aten.set_.source_Storage}
# the output's size depends on the data: the host waits for the GPU to know it
_SYNCING_OPS = {"aten::nonzero", "aten::bincount", "aten::unique_consecutive", "aten::_unique2", "aten::_unique",
                "aten::masked_select", "aten::equal", "aten::is_nonzero", "aten::allclose"}
# Python calls that read a device tensor on the host
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.cpu,
               torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class ComputeCounts:
    """Launches and host syncs issued by compute threads (thread safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.launches = 0
        self.syncs = 0
        self.sync_sites: dict[str, int] = {}  # what synced, for the error message of a test

    def add(self, launches: int = 0, sync: str | None = None) -> None:
        with self.lock:
            self.launches += launches
            if sync is not None:
                self.syncs += 1
                self.sync_sites[sync] = self.sync_sites.get(sync, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {"launches": self.launches, "syncs": self.syncs}


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (nested lists, tuples, dicts), in no set order:
    a plain walk, since it runs on every op of the device's lanes (pytree's is several times slower)."""
    out, stack = [], [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: ComputeCounts, on_device: Callable[[torch.Tensor], bool],
                 memory=None, check_use: Callable[[torch.Tensor], None] | None = None, kernel=None) -> None:
        super().__init__()
        self.counts, self.on_device, self.memory, self.check_use = counts, on_device, memory, check_use
        self.kernel = kernel  # kernel(func, args, kwargs, out): each op's accesses (the emulated race check)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Nothing runs under torch.compile here; torch's default wraps the mode in a dynamo guard whose
        first call imports torch._dynamo (~3 s of every process that starts an emulated device)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if self.check_use is not None:
            for t in inputs:
                self.check_use(t)
        name = func._schema.name
        if (name in _SYNCING_OPS or name == "aten::repeat_interleave" and "output_size" not in kwargs) \
                and any(self.on_device(t) for t in inputs):
            self.counts.add(sync=name)
        elif name == "aten::_grouped_mm" and self.on_device(args[0]) \
                and not grouped_mm_fast_on(args[0].device, args[0].dtype):
            self.counts.add(sync=name)  # its fallback reads the offsets on the host
        out = func(*args, **kwargs)
        if func not in _NOT_LAUNCHES and not func.is_view:
            self.counts.add(launches=1)
        if self.memory is not None:
            known = {t.untyped_storage().data_ptr() for t in inputs}
            for t in _tensors(out):
                if t.untyped_storage().data_ptr() not in known:
                    self.memory.track(t, name)
        if self.kernel is not None:
            self.kernel(func, args, kwargs, out)
        return out


class _HostReads(TorchFunctionMode):
    def __init__(self, counts: ComputeCounts, on_device: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.counts, self.on_device = counts, on_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if args and isinstance(args[0], torch.Tensor) and self.on_device(args[0]):
            if func in _HOST_READS or (func is torch.Tensor.to and _to_host_device(args, kwargs)):
                self.counts.add(sync=getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _to_host_device(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu" \
        and not kwargs.get("non_blocking", False)


def counting(counts: ComputeCounts, on_device: Callable[[torch.Tensor], bool], memory=None,
             check_use: Callable[[torch.Tensor], None] | None = None, kernel=None) -> ExitStack:
    """Enter the counting modes on the calling thread (exit the returned stack to stop)."""
    stack = ExitStack()
    stack.enter_context(_HostReads(counts, on_device))
    stack.enter_context(_Dispatch(counts, on_device, memory, check_use, kernel))
    return stack


@contextlib.contextmanager
def uncounted():
    """Work of the emulation itself (poisoning, bookkeeping copies), invisible to the counting modes."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def stream_order_check(memory) -> Callable[[torch.Tensor], None]:
    """A check of each tensor a compute kernel touches: a block from another lane's pool must have
    been recorded for the compute lane (else CUDA's allocator may give it to that lane's next
    allocation while the kernel is still queued)."""

    def check(t: torch.Tensor) -> None:
        block = memory.block_of(t)
        if block is None or block.buffer is None or not block.live:
            return
        lane = current_lane()
        if block.lane == lane or lane in block.recorded:
            return
        ev = current_event()
        raise StreamOrderError(
            f"{ev.name if ev else 'compute'}: the {lane} lane uses a block of the {block.lane} lane's pool "
            f"({block.tag!r}) without record_stream: on a GPU the allocator may hand it to the {block.lane} "
            f"lane's next allocation while this kernel is still queued")

    return check


COUNTED_DECODE_PASSES = 4  # on CUDA the modes cost Python time per kernel: count the first passes only


class DecodeCounts:
    """An executor's decode passes as its report gives them: host syncs the compute lane issued per
    decode step and kernel launches per layer pass (one layer over one micro-batch)."""

    def __init__(self, device) -> None:
        self.device = device
        self.passes = self.syncs = self.launches = self.layer_passes = 0

    @contextlib.contextmanager
    def step(self, layer_passes: int):
        counting = self.device.kind != "cuda" or self.passes < COUNTED_DECODE_PASSES
        self.device.count_compute(counting)
        before = self.device.counters()
        try:
            yield
        finally:
            self.device.count_compute(False)
        if counting:
            after = self.device.counters()
            self.passes += 1
            self.syncs += after.get("syncs", 0) - before.get("syncs", 0)
            self.launches += after.get("launches", 0) - before.get("launches", 0)
            self.layer_passes += layer_passes

    def stats(self) -> dict:
        out = {"device": self.device.kind, "device_memory_peak": self.device.memory_peak,
               "pageable_copies": self.device.counters().get("pageable_copies", 0)}
        if self.passes:
            out |= {"gpu_lane_syncs_per_step": self.syncs / self.passes,
                    "launches_per_layer_pass": self.launches / max(1, self.layer_passes),
                    "counted_decode_steps": self.passes}
        return out
