"""Lane workers: one thread per lane, serial, ready-first in launch order (the simulator's rule).

A task is ready when each dependency is launched (a stream lane's task: its stream orders the
work on the device) or done (a host lane's task: its result is on the host). The device's
`launch` hook runs a task on its lane thread; it may finish the work later (an emulated copy
stream) and then calls `complete`. Every task gets a vector clock: for each lane, the latest of
its tasks this one is ordered after, through its dependencies and its own lane's order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moelight.devices.device_base import (
    DEVICE_LANES,
    JOIN_SECONDS,
    STREAM_LANES,
    DependencyFailed,
    Event,
    bind_current,
)


@dataclass
class LaneItem:
    fn: Callable[[], None]
    deps: tuple[Event, ...]
    event: Event
    nbytes: float


def dependency_ready(dep: Event) -> bool:
    """A dependency lets a task launch: a stream task once launched, a host task once done."""
    return dep.error is not None or (dep.launched if dep.lane in STREAM_LANES else dep.done)


@dataclass
class LaneSet:
    """Worker threads, one per lane, sharing one condition variable."""

    launch: Callable[[str, LaneItem], None]
    lanes: Sequence[str] = DEVICE_LANES
    done_on_launch: Sequence[str] = DEVICE_LANES  # lanes whose work has run when their function returns
    thread_init: Callable[[str], None] | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        self.queues: dict[str, list[LaneItem]] = {lane: [] for lane in self.lanes}
        self.pending = 0
        self.first_error: BaseException | None = None
        self.stopping = False
        self.position = {lane: -1 for lane in self.lanes}  # latest launched task per lane
        self.done_position = {lane: -1 for lane in self.lanes}  # latest completed (lanes complete in order)
        self.last_clock: dict[str, dict[str, int]] = {lane: {} for lane in self.lanes}
        self.on_complete: list[Callable[[], None]] = []  # called (outside the lock) after any completion
        self.threads = [threading.Thread(target=self._loop, args=(lane,), name=f"moelight-{lane}", daemon=True)
                        for lane in self.lanes]
        for t in self.threads:
            t.start()

    def submit(self, lane: str, fn: Callable[[], None], deps: Sequence[Event], nbytes: float, name: str) -> Event:
        if lane not in self.queues:
            raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(self.lanes)}")
        ev = Event(name, lane)
        with self.cond:
            self.queues[lane].append(LaneItem(fn, tuple(deps), ev, nbytes))
            self.pending += 1
            self.cond.notify_all()
        return ev

    def issued_clock(self, lane: str) -> dict[str, int]:
        """The clock of the latest task launched on `lane`."""
        with self.cond:
            return dict(self.last_clock[lane])

    def order_after(self, lane: str, clock: dict[str, int]) -> None:
        """`lane`'s tasks launched from now on come after `clock`: work issued on the lane's stream from
        outside its worker (`Device.compute()`)."""
        with self.cond:
            mine = self.last_clock[lane]
            for other, pos in clock.items():
                if mine.get(other, -1) < pos:
                    mine[other] = pos

    def _pick(self, lane: str) -> LaneItem | None:
        for k, it in enumerate(self.queues[lane]):
            if all(dependency_ready(d) for d in it.deps):
                return self.queues[lane].pop(k)
        return None

    def _order(self, lane: str, item: LaneItem) -> None:
        """Its place on the lane and its vector clock (under the lock)."""
        self.position[lane] += 1
        clock = dict(self.last_clock[lane])
        for d in item.deps:
            for other, pos in d.clock.items():
                if clock.get(other, -1) < pos:
                    clock[other] = pos
        clock[lane] = self.position[lane]
        item.event.position, item.event.clock = self.position[lane], clock
        self.last_clock[lane] = clock

    def _loop(self, lane: str) -> None:
        if self.thread_init is not None:
            self.thread_init(lane)
        while True:
            item = self._next(lane)
            if item is None:  # closed
                return
            err = next((d.error for d in item.deps if d.error is not None), None)
            timed = lane in self.done_on_launch  # other lanes' times are their device work's (set by the device)
            t0 = time.perf_counter()
            if timed:
                item.event.t_start = t0
            if err is None:
                bind_current(lane, item.event)
                try:
                    self.launch(lane, item)
                except BaseException as e:  # noqa: BLE001 - reported through synchronize()
                    err = e
                finally:
                    bind_current(lane, None)
            else:
                err = DependencyFailed(f"{item.event.name}: a dependency failed ({err!r})")
            if timed:
                item.event.t_end = time.perf_counter()
                item.event.t_start = max(item.event.t_start, t0)
            with self.cond:
                item.event.launched = True
                self.cond.notify_all()
            if err is not None or lane in self.done_on_launch:
                self.complete(item.event, err)

    def _next(self, lane: str) -> LaneItem | None:
        """The lane's next ready task, in its place; None once the set is closed. What is still queued
        then (a failed job's remaining work) is failed, not run: no worker is left inside a kernel when
        the process exits (a C++ abort, exit code 134, after a device ran out of memory)."""
        with self.cond:
            while not self.stopping:
                item = self._pick(lane)
                if item is not None:
                    self._order(lane, item)
                    return item
                self.cond.wait(timeout=0.05)
            dropped, self.queues[lane] = self.queues[lane], []
        for it in dropped:
            self.complete(it.event, RuntimeError(f"{it.event.name}: the device closed before it ran"))
        return None

    def complete(self, event: Event, error: BaseException | None = None) -> None:
        """The work of a launched task has run (or failed)."""
        with self.cond:
            if error is not None and event.error is None:
                event.error = error
                if self.first_error is None:
                    self.first_error = error
            event.launched = event.done = True
            if event.lane in self.done_position:
                self.done_position[event.lane] = max(self.done_position[event.lane], event.position)
            self.pending -= 1
            self.cond.notify_all()
        for hook in self.on_complete:
            hook()

    def wait_done(self, events: Sequence[Event]) -> None:
        """Block until these tasks' work has run (a device-side wait, emulated on the host)."""
        with self.cond:
            while not all(e.done for e in events):
                self.cond.wait(timeout=0.05)

    def wait_all(self) -> None:
        """Block until every submitted task is done; raise the first error, if any."""
        with self.cond:
            while self.pending:
                self.cond.wait(timeout=0.05)
            err, self.first_error = self.first_error, None
        if err is not None:
            raise err

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self.threads:  # a worker finishes the task it is in, then stops
            t.join(timeout=JOIN_SECONDS)
