"""The expert cache's copy thread: a copy that fails is reported to the compute that waits for it,
however the wait and the failure interleave (a failed job is also marked done)."""

from __future__ import annotations

import threading

import pytest
import torch

from moelight.expert_cache.cache_state import Fetch
from moelight.expert_cache.copy_worker import CopyWorker


class _FailingLink:
    """The part of a device the worker calls: every transfer raises, once `go` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.waited: list = []

    def transfer(self, pairs, after=None):
        self.go.wait()
        raise OSError("the link went away")

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def bind_thread(self, lane: str) -> None:
        pass


def _worker(link: _FailingLink) -> CopyWorker:
    return CopyWorker(link, lambda f: [[(torch.empty(4), torch.ones(4))]])


@pytest.mark.parametrize("fails", ["before the wait", "during the wait"])
def test_a_failed_copy_is_raised_to_the_compute_that_waits_for_it(fails):
    link = _FailingLink()
    worker = _worker(link)
    try:
        worker.submit([Fetch(key=7, slot=0, demand=True, priority=0.0, order=0)])
        if fails == "before the wait":  # the job is done (failed) before anyone waits for it
            link.go.set()
            while worker.pending(7):
                pass
        else:
            threading.Timer(0.05, link.go.set).start()
        with pytest.raises(RuntimeError, match="expert copy failed: OSError.*the link went away"):
            worker.wait(7)
        assert link.waited == []  # the compute was not told to go on
    finally:
        worker.close()
