"""Suite-wide guards (no test profiles this machine or writes its profile cache by accident) and the
kernel-backend fixture the CPU-kernel tests share."""

from __future__ import annotations

import pytest
import torch


def _backends() -> list[str]:
    import cpu_kernels

    isas = ["avx512bf16", "avx512", "avx2"] if cpu_kernels.kernel_backend() != "torch" else []
    return ["torch", *[f"cpp-{i}" for i in isas]]


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    """Selects the kernel path under test (the pure-torch fallback or one C++ ISA); ISAs the CPU
    lacks are skipped."""
    from cpu_kernels import dispatch

    name = request.param
    if name == "torch":
        monkeypatch.setitem(dispatch._state, "loaded", False)
        yield name
        return
    isa = name.removeprefix("cpp-")
    if torch.ops.moelight.set_isa(isa) != isa:
        torch.ops.moelight.set_isa("auto")
        pytest.skip(f"CPU lacks {isa}")
    yield name
    torch.ops.moelight.set_isa("auto")


@pytest.fixture(autouse=True)
def fixed_hardware_profile(tmp_path_factory, monkeypatch):
    """Point the cached-profile path at a fixed CPU spec, so `--hardware profile` (the default of
    `moelight run` and `LLM`) plans against the same numbers on every host and takes no profile.
    Tests of the profiling itself monkeypatch the path again."""
    from hrm import hardware_presets

    path = tmp_path_factory.getbasetemp() / "hardware.json"
    if not path.is_file():
        hardware_presets.HARDWARE_PRESETS["cpu-server"].save(path)
    monkeypatch.setattr(hardware_presets, "DEFAULT_PROFILE_PATH", path)
