"""ARCHITECTURE.md "Layers": dependencies point one way, and the policy search (hrm, optimizer) never needs torch.

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


def _lint_imports(*config: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", "--no-logo", *map(str, config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    """pyproject.toml's import-linter contracts: the layers of ARCHITECTURE.md import one way only,
    hrm / optimizer / workloads import neither torch nor the engine, and no package has an import circle."""
    r = _lint_imports()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "kept" in r.stdout


def test_the_contracts_can_fail(tmp_path):
    """The same check, given the jobs layer below the engine and workloads allowed nothing, breaks."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in cfg["contracts"] if c["type"] == "layers")["layers"]
    swapped = [*layers]
    i, j = swapped.index("moelight.jobs"), swapped.index("moelight.engine")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    body = "\n".join([
        "[tool.importlinter]",
        f"root_packages = {cfg['root_packages']!r}".replace("'", '"'),
        "include_external_packages = true",
        "[[tool.importlinter.contracts]]",
        'name = "swapped"',
        'type = "layers"',
        "layers = [" + ", ".join(f'"{x}"' for x in swapped) + "]",
    ])
    bad = tmp_path / "swapped.toml"
    bad.write_text(body + "\n")
    r = _lint_imports(bad)
    assert r.returncode != 0 and "BROKEN" in r.stdout and "moelight.jobs" in r.stdout
