"""The install step (setup.py) builds the C++ kernels, and only a build of the current sources loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_kernels
from cpu_kernels import build

ROOT = Path(__file__).resolve().parents[1]
REINSTALL = "re-run `pip install --no-build-isolation -e .` from the repository root"


def test_install_step_built_the_kernels_that_run():
    lib = build.prebuilt_library()
    if lib is None:
        if not (shutil.which("c++") or shutil.which("g++")):
            pytest.skip("no C++ compiler: the install step cannot build cpu_kernels/lib/")
        pytest.fail(f"cpu_kernels/lib/ was not built by the install step: {REINSTALL}")
    if build.source_hash_marker() not in lib.read_bytes():
        pytest.skip(f"cpu_kernels/csrc changed since the install built {lib.name}: {REINSTALL}")
    assert cpu_kernels.kernel_backend() != "torch"
    assert build.loaded_from == "install-time build"


def test_a_build_of_other_sources_is_refused_before_loading(monkeypatch):
    """An edited csrc/ must compile afresh, not load the stale install-time library."""
    monkeypatch.setattr(build, "source_hash_marker", lambda: b"moelight-source-hash=0000000000000000;")
    if build.prebuilt_library() is None:
        with pytest.raises(FileNotFoundError):
            build._load_prebuilt()
    else:
        with pytest.raises(RuntimeError, match="built from other sources"):
            build._load_prebuilt()


def test_source_hash_define_is_a_bare_token():
    """The flag passes through ninja's shell: no quotes or spaces, and it names the marker's hash."""
    flag = build.source_hash_define()
    name, value = flag.removeprefix("-D").split("=")
    assert name == "MOELIGHT_SOURCE_HASH" and value.isalnum()
    assert build.source_hash_marker() == f"moelight-source-hash={value};".encode()


def _loaded_library() -> Path | None:
    """The kernels' library this process loaded: the install-time build or the JIT one."""
    if cpu_kernels.kernel_backend() == "torch":
        return None
    if build.loaded_from == "install-time build":
        return build.prebuilt_library()
    for line in Path("/proc/self/maps").read_text().splitlines():
        if f"{build.NAME}_" in line and line.endswith(".so"):
            return Path(line.split()[-1])
    return None


def test_a_lock_left_by_a_killed_process_does_not_stop_the_next_load(tmp_path):
    """torch's JIT build holds a lock file while it runs ninja, even when there is nothing to build. A
    job killed then (stopped during start-up) leaves the lock behind, and torch's load() in every later
    process waits for it forever. A library already built from these sources loads without it."""
    lib = _loaded_library() if Path("/proc/self/maps").exists() else None
    if lib is None:
        pytest.skip("no C++ kernels loaded in this process")
    name = f"{build.NAME}_{build._source_hash()}"
    built = tmp_path / name
    built.mkdir()
    shutil.copy(lib, built / f"{name}.so")
    (built / "lock").touch()
    code = "from cpu_kernels import build; assert build._load_jit(False)"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60, cwd=ROOT)


def test_a_lock_no_build_touched_for_minutes_is_dropped(tmp_path):
    """Where nothing is built yet, a lock in a directory nothing wrote to for STALE_LOCK_S belongs to a
    killed build: it goes. A lock beside a file written a moment ago may be a live build's: it stays."""
    (tmp_path / "build.ninja").touch()
    (tmp_path / "lock").touch()
    now = (tmp_path / "lock").stat().st_mtime
    assert not build._drop_stale_lock(tmp_path, now=now + 5)
    assert (tmp_path / "lock").exists()
    assert build._drop_stale_lock(tmp_path, now=now + build.STALE_LOCK_S + 1)
    assert not (tmp_path / "lock").exists()
    assert not build._drop_stale_lock(tmp_path / "absent")
