"""The CUDA sanitizer's rule on the emulated device's lanes (opt-in: MOELIGHT_EMULATED_RACE_CHECK=1).

The emulated compute lane runs each kernel when it is issued, so it never lags the host: a copy
that a real GPU would run while a queued kernel still reads its destination (or a read that is
right only because of host timing) goes unnoticed there. This check does not depend on timing: like
TORCH_CUDA_SANITIZER, it keeps each device tensor's last write and the reads since (keyed by data
pointer, as the sanitizer keys them), and a new access must be ordered after them. A task is ordered
after another when it follows it on its own lane or through its dependencies (the lanes' vector
clocks: on CUDA, `wait_event` on the dependency's event). `synchronize` orders everything.

Compute issued from a thread of its own (`Device.compute()`: latency mode's passes, the weight pager's
load) runs on CUDA's compute stream after what that stream already holds; its expert copies come from the
expert cache's copy thread (`transfer`). The check gives that compute a lane of its own (DIRECT_LANE, a
new position at each `record_event`), ordered after the compute lane's tasks issued before it and before
those issued after it, and the copies another (COPY_LANE): a copy comes after the `record_event` it is
given, compute after the copy it `wait_event`s.
"""

from __future__ import annotations

import os
import threading

import torch

from moelight.devices.device_base import Event, StreamOrderError, current_event

ENV = "MOELIGHT_EMULATED_RACE_CHECK"
DIRECT_LANE = "gpu (direct)"  # compute issued from a thread of its own (Device.compute())
COPY_LANE = "h2d (transfer)"  # copies issued from a thread outside the lanes (Device.transfer)


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
        self.direct = _event("compute", DIRECT_LANE, 0, {})  # the current point of the direct compute
        self.transfers = 0

    def record_point(self) -> Event:
        """`record_event` on the direct compute: an event after every kernel issued so far (done: the
        emulated compute has run them); the kernels issued after it come later."""
        with self.lock:
            d = self.direct
            ev = _event("compute up to a recorded event", DIRECT_LANE, d.position, dict(d.clock))
            d.position += 1
            d.clock[DIRECT_LANE] = d.position
        ev.launched = ev.done = True
        return ev

    def transfer(self, ev: Event, dsts: list[torch.Tensor], after: Event | None) -> None:
        """`ev`: a copy into `dsts` issued after `after` (an event, or None: ordered after nothing)."""
        with self.lock:
            ev.lane, ev.position = COPY_LANE, self.transfers
            self.transfers += 1
            ev.clock = _merged({COPY_LANE: ev.position}, after.clock if after is not None else {})
        for t in dsts:
            self.access(t, True, "copy", ev)

    def waited(self, clock: dict[str, int]) -> None:
        """The direct compute waits for work up to `clock` (`wait_event`, or the compute lane's tasks issued
        before it on the same stream): its later kernels are ordered after it."""
        with self.lock:
            self.direct.clock = _merged(self.direct.clock, clock)

    def direct_clock(self) -> dict[str, int]:
        with self.lock:
            return dict(self.direct.clock)

    def reset(self) -> None:
        """Everything issued so far has run (a synchronize)."""
        with self.lock:
            self.records.clear()

    def forget(self, t: torch.Tensor) -> None:
        """A storage handed out anew: its earlier accesses belong to another tensor."""
        with self.lock:
            self.records.pop(t.untyped_storage().data_ptr(), None)

    def access(self, t: torch.Tensor, write: bool, what: str, ev: Event | None = None) -> None:
        ev = ev or current_event()
        if ev is None or ev.position < 0 or not self.on_device(t):
            return  # outside the lanes and the direct compute (loading): not modelled here
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
        name = func._schema.name
        if func.is_view or name in _METADATA_ONLY:
            return
        for arg, value in _arguments(func._schema, args, kwargs):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                self.access(t, written, name)
        for t in _tensors(out):
            self.access(t, True, name)


# ops that change a tensor's view of its storage, not the memory (their schema marks `self` written):
# Triton's interpreter rebinds its arguments' storages with set_ around every kernel
_METADATA_ONLY = frozenset({"aten::set_", "aten::as_strided_", "aten::detach_", "aten::squeeze_", "aten::unsqueeze_",
                            "aten::t_", "aten::transpose_", "aten::swapdims_", "aten::swapaxes_"})


def _event(name: str, lane: str, position: int, clock: dict[str, int]) -> Event:
    ev = Event(name, lane)
    ev.position, ev.clock = position, clock | {lane: position}
    return ev


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {lane: max(a.get(lane, -1), b.get(lane, -1)) for lane in a.keys() | b.keys()}


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
