"""The ranks meeting in torch's default process group: a bounded wait that Ctrl-C and SIGTERM end.

Why: `init_process_group` waits in C++ until every rank has come, and Python runs signal handlers
only between bytecodes, so a signal did nothing until it returned; with the ranks' 2-hour load
timeout, a peer that never starts (a torchrun rank that failed to launch, or RANK and WORLD_SIZE
inherited from an outer launcher) held the job silently for 2 hours. Here the wait runs on a
helper thread while the main thread waits in short slices, where a signal raises as usual
(KeyboardInterrupt, or the CLI's Terminated: exit 130 / 143), and it ends after its own timeout
(MOELIGHT_TP_RENDEZVOUS_TIMEOUT, 300 s by default) with an error that says what to do; rank 0 of
ranks it spawned stops as soon as one of them has exited instead (`gone`), since it will never come.
The wait for a slower rank's load, later, keeps the long timeout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from moelight.parallel.sharding import TensorParallelError

RENDEZVOUS_ENV = "MOELIGHT_TP_RENDEZVOUS_TIMEOUT"  # seconds the ranks may take to meet, default 300
_DEFAULT_S = 300.0


def rendezvous_timeout() -> timedelta:
    """How long a rank waits for the others to join (MOELIGHT_TP_RENDEZVOUS_TIMEOUT seconds)."""
    raw = os.environ.get(RENDEZVOUS_ENV, str(_DEFAULT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise TensorParallelError(f"{RENDEZVOUS_ENV}={raw!r}: give how long the ranks may take to meet, "
                                  "in seconds (> 0)")
    return timedelta(seconds=seconds)


def rendezvous(backend: str, init_method: str | None, rank: int, world: int, where: str, hint: str,
               load_timeout: timedelta, log: Callable[[str], None] | None = None,
               gone: Callable[[], str | None] | None = None) -> None:
    """init_process_group, bounded by the rendezvous timeout and interruptible by signals. `where`
    names the address the ranks meet at; `hint` says what to do when the others never come; `gone`,
    polled while waiting, says why a rank will never come (it has exited), and the wait ends there. Once
    every rank has come, the group's store takes `load_timeout` (a rank may then wait for a slower
    one's load)."""
    timeout = rendezvous_timeout()
    if log is not None:
        log(f"rank {rank} of {world}: waiting for the other {world - 1} rank(s) at {where} "
            f"(up to {timeout.total_seconds():g} s; {RENDEZVOUS_ENV} sets it)")
    failed: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        except BaseException as e:  # handed to the main thread
            failed.append(e)

    helper = threading.Thread(target=join, name="moelight-rendezvous", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.1)  # a signal's handler runs here; its exception leaves the helper to time out
        why = gone() if gone is not None and helper.is_alive() else None
        if why is not None:  # the helper is left to time out, as after a signal
            raise TensorParallelError(f"rank {rank} of {world} stopped waiting at {where}: {why}")
    if failed:
        e = failed[0]
        if isinstance(e, dist.DistStoreError) or "timed out" in str(e).lower() or "timeout" in str(e).lower():
            raise TensorParallelError(f"rank {rank} of {world} waited {timeout.total_seconds():g} s at {where} and "
                                      f"not every rank came: {hint}; {RENDEZVOUS_ENV} (seconds) waits longer") from e
        raise e
    try:
        dist.distributed_c10d._get_default_store().set_timeout(load_timeout)
    except Exception:  # an older torch: the store keeps the rendezvous timeout (the groups keep their own)
        pass
