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
