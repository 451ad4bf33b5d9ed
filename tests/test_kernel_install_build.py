"""The install step (setup.py) builds the C++ kernels, and only a build of the current sources loads."""

from __future__ import annotations

import shutil

import pytest

import cpu_kernels
from cpu_kernels import build

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
