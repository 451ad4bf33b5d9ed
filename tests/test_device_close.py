"""Closing a device's workers after a failure: the work still queued is failed, not run, so no worker
thread is inside a kernel or a copy when the process exits (a job that ran out of device memory
could end in a C++ abort, exit code 134, instead of its exit code 2)."""

from __future__ import annotations

import threading
import time

from moelight.devices.copy_stream import CopyJob, CopyStream
from moelight.devices.device_base import Event
from moelight.devices.lanes import LaneSet


def test_closing_lanes_fails_the_queued_tasks_instead_of_running_them():
    ran, started, release = [], threading.Event(), threading.Event()

    def launch(lane, item):
        item.fn()

    lanes = LaneSet(launch, ("gpu",), done_on_launch=("gpu",))

    def blocker():
        started.set()
        release.wait(5)
        ran.append("blocker")

    first = lanes.submit("gpu", blocker, (), 0.0, "blocker")
    queued = [lanes.submit("gpu", lambda k=k: ran.append(k), (), 0.0, f"task{k}") for k in range(5)]
    assert started.wait(5)
    closing = threading.Thread(target=lanes.close)
    closing.start()
    time.sleep(0.2)  # close has asked the worker to stop while it is in the blocker
    release.set()
    closing.join(10)
    assert not closing.is_alive() and not any(t.is_alive() for t in lanes.threads)
    assert ran == ["blocker"] and first.done and first.error is None
    assert all(e.done and "closed before it ran" in str(e.error) for e in queued)


def test_closing_a_copy_stream_fails_its_queued_copies_instead_of_running_them():
    finished = []
    stream = CopyStream("h2d", bandwidth=1e3, wait_done=lambda events: None)  # 1 kB/s: seconds a job
    jobs = [CopyJob([], Event(f"copy{k}", "h2d"), 2e3, finish=lambda err, k=k: finished.append((k, err)))
            for k in range(4)]
    for job in jobs:
        stream.enqueue(job)
    time.sleep(0.1)  # the worker is in the first copy's 2 s
    t0 = time.perf_counter()
    stream.close()
    assert time.perf_counter() - t0 < 4 and not stream.thread.is_alive()  # not the 8 s of running all four
    errors = dict(finished)
    assert errors[0] is None  # the copy it was in completed
    assert all("closed before the copy ran" in str(errors[k]) for k in (1, 2, 3))


def test_closing_the_expert_cache_waits_for_the_copies_it_issued():
    """ExpertCacheExecutor.close(): its copy thread stops after the copy under way, then the device is
    synchronized before it closes, so no copy it issued is abandoned mid-flight (on CUDA: into slots
    about to be freed)."""
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor
    from moelight.expert_cache.cache_state import Fetch
    from moelight.expert_cache.policy_registry import make_policy
    from moelight.models.config import ModelConfig
    from tests.tp_helpers import random_model

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, top_k=2, head_dim=8, max_position_embeddings=64)
    model = random_model(cfg, seed=1)
    ex = ExpertCacheExecutor(model, 4, make_policy("on-demand", 2, 4), "emulated", max_tokens=16,
                             h2d_bandwidth=2e5)  # an expert (18 KiB) takes ~0.1 s
    keys = [0, 1, 2]
    ex.worker.submit([Fetch(k, k, True, 0.0, k) for k in keys])
    for k in keys:
        assert ex.worker.done[k].wait(10)  # issued: queued on the h2d stream, not yet run
    copies = [ex.worker.device_done[k] for k in keys]
    assert not copies[-1].done
    ex.close()
    assert all(c.done and c.error is None for c in copies)
