"""The CUDA sanitizer's rule on the emulated device's lanes (opt-in: MOELIGHT_EMULATED_RACE_CHECK=1).

The emulated compute lane runs each kernel when it is issued, so it never lags the host: a copy
that a real GPU would run while a queued kernel still reads its destination (or a read that is
right only because of host timing) goes unnoticed there. This check does not depend on timing: like
TORCH_CUDA_SANITIZER, it keeps each device tensor's last write and the reads since (keyed by data
pointer, as the sanitizer keys them), and a new access must be ordered after them. A task is ordered
after another when it follows it on its own lane or through its dependencies (the lanes' vector
clocks: on CUDA, `wait_event` on the dependency's event). `synchronize` orders everything.
"""

from __future__ import annotations

import os
import threading

import torch

from moelight.devices.device_base import Event, StreamOrderError, current_event

ENV = "MOELIGHT_EMULATED_RACE_CHECK"


def wanted() -> bool:
    return os.environ.get(ENV) == "1"


def _ordered_after(ev: Event, prev: tuple) -> bool:
    lane, position = prev[0], prev[1]
    if lane == ev.lane:
        return position <= ev.position
    return ev.clock.get(lane, -1) >= position


class RaceCheck:
    def __init__(self, on_device) -> None:
        """on_device(t): whether `t` is device memory."""
        self.on_device = on_device
        self.lock = threading.Lock()
        self.records: dict[int, dict[int, list]] = {}  # storage -> data pointer -> [last write, reads since]

    def reset(self) -> None:
        """Everything issued so far has run (a synchronize)."""
        with self.lock:
            self.records.clear()

    def forget(self, t: torch.Tensor) -> None:
        """A storage handed out anew: its earlier accesses belong to another tensor."""
        with self.lock:
            self.records.pop(t.untyped_storage().data_ptr(), None)

    def access(self, t: torch.Tensor, write: bool, what: str) -> None:
        ev = current_event()
        if ev is None or ev.position < 0 or not self.on_device(t):
            return  # outside the lanes (loading, the expert cache's own threads): not modelled here
        me = (ev.lane, ev.position, ev.name, what, "write" if write else "read")
        with self.lock:
            rec = self.records.setdefault(t.untyped_storage().data_ptr(), {}).setdefault(t.data_ptr(), [None, []])
            earlier = (rec[1] or [rec[0]]) if write else [rec[0]]
            for prev in earlier:
                if prev is not None and not _ordered_after(ev, prev):
                    raise StreamOrderError(
                        f"{ev.name} ({ev.lane} lane, {what}) {me[4]}s device memory that {prev[2]} ({prev[0]} lane, "
                        f"{prev[3]}) {prev[4]}s, and is not ordered after it: a race on a GPU")
            if write:
                rec[0], rec[1] = me, []
            else:
                rec[1].append(me)

    def kernel(self, func, args, kwargs, out) -> None:
        """A compute-lane op: the arguments it writes (its schema says which), those it reads, its outputs."""
        if func.is_view:
            return
        name = func._schema.name
        for arg, value in _arguments(func._schema, args, kwargs):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                self.access(t, written, name)
        for t in _tensors(out):
            self.access(t, True, name)


def _arguments(schema, args, kwargs):
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
