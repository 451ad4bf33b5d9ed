"""pytest plugin: TORCH_CUDA_SANITIZER's race reports collected instead of raised, one line per
distinct pair of accesses, so one run over the `cuda` matrix lists every race (plain CSAN stops each
test at its first report and prints ~100 lines of stack per report).

    TORCH_CUDA_SANITIZER=1 python -m pytest -m cuda -p tests.cuda_sanitizer_report -q

Each report names the kernel, the access (r/w) and the stream of both accesses, with the innermost
project frames of each stack, and the tests where it occurred; the report is written after every
test to `$MOELIGHT_CSAN_REPORT` (default: cuda-sanitizer-report.txt; one file per xdist worker).
The runtime's device threads join the sanitizer, whose records are then updated under one lock
(moelight/devices/cuda_sanitizer.py), so their kernels are checked too, without false reports.
"""

from __future__ import annotations

import collections
import os
import re

import pytest

_SEEN: collections.Counter = collections.Counter()
_TESTS: dict[str, set[str]] = collections.defaultdict(set)
_CURRENT = ["?"]


def _frames(stack) -> list[str]:
    """The innermost three project frames of a stack, innermost first."""
    out = []
    for fs in stack or ():
        m = re.search(r"[/\\](moelight|tests|cpu_kernels)[/\\](.*)$", fs.filename)
        if m:
            out.append(f"{m.group(1)}/{m.group(2)}:{fs.lineno}:{fs.name}")
    return out[-3:][::-1]


def _access(acc) -> str:
    kind = "w" if acc.type.name == "WRITE" else "r"
    return f"{str(acc.operator).split('(')[0]} [{kind}, stream {acc.stream}] at " + " < ".join(_frames(acc.stack_trace))


def describe(error) -> str:
    """One line for a CSAN error: this access, the earlier one it is not ordered after, the allocation."""
    if not hasattr(error, "current_access"):
        return str(error).splitlines()[0][:300]
    alloc = " < ".join(_frames(error.allocation_stack_trace)[:2])
    return f"{_access(error.current_access)}  AFTER  {_access(error.previous_access)}  (allocated at {alloc})"


def pytest_configure(config):
    if not os.environ.get("TORCH_CUDA_SANITIZER"):
        raise pytest.UsageError("tests.cuda_sanitizer_report: run with TORCH_CUDA_SANITIZER=1")
    from torch.cuda import _sanitizer

    original = _sanitizer.EventHandler._handle_kernel_launch

    def collect(self, *args, **kwargs):
        for error in original(self, *args, **kwargs):
            line = describe(error)
            _SEEN[line] += 1
            _TESTS[line].add(_CURRENT[0])
        return []  # reported, not raised: the test goes on to its own checks

    _sanitizer.EventHandler._handle_kernel_launch = collect


def pytest_runtest_setup(item):
    _CURRENT[0] = item.nodeid


def pytest_runtest_teardown(item):
    _write()


def _write() -> None:
    path = os.environ.get("MOELIGHT_CSAN_REPORT", "cuda-sanitizer-report.txt")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        root, ext = os.path.splitext(path)
        path = f"{root}-{worker}{ext}"
    lines = [f"{n} x {line}\n    in {sorted(_TESTS[line])[:4]}" for line, n in _SEEN.most_common()]
    with open(path, "w") as f:
        f.write("\n".join(lines + [f"{len(_SEEN)} distinct race reports"]) + "\n")
