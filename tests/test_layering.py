"""DESIGN.md §1: dependencies point one way, and planning never needs torch.

`hrm` (numpy only) and `optimizer` (hrm) never import torch; `workloads` imports neither
torch nor moelight. Each check imports every submodule in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    pkg_name, forbidden = sys.argv[1], sys.argv[2].split(",")
    pkg = importlib.import_module(pkg_name)
    names = [pkg_name]
    for info in pkgutil.walk_packages(pkg.__path__, pkg_name + "."):
        names.append(info.name)
    skipped = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:  # an optional dependency (matplotlib for plots) may be absent
            if e.name and e.name.split(".")[0] in ("matplotlib",):
                skipped.append(name)
                continue
            raise
    bad = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    assert not bad, f"importing {pkg_name} pulled in {bad[:10]}"
    print(len(names), "modules", "skipped:", skipped)
    """
)


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("hrm", ["torch", "moelight", "optimizer", "workloads", "cpu_kernels"]),
        ("optimizer", ["torch", "moelight", "workloads", "cpu_kernels"]),
        ("workloads", ["torch", "moelight", "optimizer", "hrm", "cpu_kernels"]),
    ],
)
def test_package_does_not_import(package, forbidden):
    r = subprocess.run([sys.executable, "-c", CHECK, package, ",".join(forbidden)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "modules" in r.stdout


def test_planning_entry_points_without_torch():
    """The exact line of the issue: hrm, optimizer and optimizer.search import without torch."""
    code = "import sys, hrm, optimizer, optimizer.search; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def test_check_can_fail():
    """The subprocess check really sees torch when a module imports it."""
    r = subprocess.run([sys.executable, "-c", CHECK, "cpu_kernels", "torch"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "pulled in" in r.stderr
