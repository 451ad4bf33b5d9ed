"""The sanitizer report plugin's one line per race: both accesses with their kernel, kind, stream and
project frames (a run on a GPU is only as useful as what it writes down)."""

from __future__ import annotations

import traceback

import torch.cuda._sanitizer as san

from tests.cuda_sanitizer_report import describe


class _Schema:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:  # CSAN hands over a FunctionSchema, not a string
        return self.text


def _stack(*frames):
    return traceback.StackSummary.from_list([(f, n, name, None) for f, n, name in frames])


def test_a_race_is_one_line_naming_both_accesses():
    later = san.Access(san.AccessType.READ, 9, 111, _Schema("aten::mm(Tensor self, Tensor mat2) -> Tensor"),
                       ["self"], False, _stack(("/site/torch/x.py", 1, "t"), ("/r/moelight/models/moe.py", 37, "f")))
    earlier = san.Access(san.AccessType.WRITE, 4, 222, _Schema("aten::copy_(Tensor(a!) self) -> Tensor(a!)"),
                         ["self"], True, _stack(("/r/tests/t.py", 5, "test"), ("/r/moelight/devices/cuda_device.py",
                                                                                  199, "copy")))
    alloc = _stack(("/r/moelight/expert_cache/expert_slots.py", 37, "__init__"))
    line = describe(san.UnsynchronizedAccessError(1, alloc, later, earlier))
    assert line == ("aten::mm [r, stream 111] at moelight/models/moe.py:37:f  AFTER  aten::copy_ [w, stream 222] at "
                    "moelight/devices/cuda_device.py:199:copy < tests/t.py:5:test  "
                    "(allocated at moelight/expert_cache/expert_slots.py:37:__init__)")


def test_an_ordered_copy_read_on_another_thread_is_no_race_once_the_bookkeeping_is_serialized(monkeypatch):
    """The lane threads share the sanitizer's records. A copy's write takes the global sequence number
    after a stack walk: if another thread's kernel is counted meanwhile, the write is recorded as later
    than the event recorded after it, and a read that waited for that event reads as a race (a thread
    switch forced at that point here). Serialized, the same order is no race."""
    import threading
    import types

    from moelight.devices.cuda_sanitizer import serialize_sanitizer

    handler = san.EventHandler()
    serialize_sanitizer(handler)
    copy_stream, compute_stream, written, event = 11, 22, 1000, 5000
    for s in (copy_stream, compute_stream):
        handler._handle_stream_creation(s)
    other: list[threading.Thread] = []

    class Stacks:
        @staticmethod
        def extract(frames, **kw):
            if not other:  # the copy's bookkeeping: the compute thread launches a kernel now
                t = threading.Thread(target=handler._handle_kernel_launch,
                                     args=(compute_stream, {1}, set(), set(), "aten::add", {1: []}))
                other.append(t)
                t.start()
                t.join(0.5)  # serialized: it waits for the copy's record to be complete
            return traceback.StackSummary.extract(frames, **kw)

    monkeypatch.setattr(san, "traceback", types.SimpleNamespace(StackSummary=Stacks, walk_stack=traceback.walk_stack))
    assert handler._handle_kernel_launch(copy_stream, set(), {written}, set(), "aten::copy_", {written: []}) == []
    handler._handle_event_creation(event)
    handler._handle_event_record(event, copy_stream)  # after the copy, on its stream
    handler._handle_event_wait(event, compute_stream)  # the reader's stream waits for it
    errors = handler._handle_kernel_launch(compute_stream, {written}, set(), set(), "aten::mm", {written: []})
    other[0].join()
    assert errors == []
