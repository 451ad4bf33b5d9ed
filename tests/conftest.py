"""Suite-wide guards: no test profiles this machine or writes its profile cache by accident; the
`cuda` marker's tests (the GPU matrix) run where a GPU is, under CUDA's sync-debug mode. And the
kernel-path fixtures the CPU-kernel tests share."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# the emulated device checks every cross-lane access as TORCH_CUDA_SANITIZER would (devices/race_check.py);
# in the environment, so ranks spawned by the TP tests inherit it. A value given from outside holds for
# every test; otherwise every test but those marked `no_race_check` runs with it.
RACE_CHECK = "MOELIGHT_EMULATED_RACE_CHECK"
RACE_CHECK_GIVEN = RACE_CHECK in os.environ


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures (module-scoped ones too), so a model a fixture builds follows its test."""
    if RACE_CHECK_GIVEN:
        return
    if item.get_closest_marker("no_race_check"):
        os.environ.pop(RACE_CHECK, None)
    else:
        os.environ[RACE_CHECK] = "1"


def device_kinds(gpus: int = 1) -> list:
    """The devices a runtime test runs on: the emulated one always, CUDA where `gpus` GPUs are
    (`python -m pytest -m cuda` runs only those; see README, "Running on a GPU")."""
    enough = HAS_CUDA and torch.cuda.device_count() >= gpus
    return ["emulated", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not enough, reason=f"needs {gpus} CUDA GPU(s)")])]


@pytest.fixture(autouse=True)
def cuda_sync_debug(request):
    """A `cuda` test warns on every synchronizing CUDA call (torch.cuda.set_sync_debug_mode)."""
    if not (HAS_CUDA and request.node.get_closest_marker("cuda")):
        yield
        return
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


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


def _isas() -> list[str]:
    import cpu_kernels

    return ["avx512bf16", "avx512", "avx2"] if cpu_kernels.kernel_backend() != "torch" else []


def _select(name: str, monkeypatch):
    """Make `name` (the pure-torch fallback or one C++ ISA) the kernel path; ISAs the CPU lacks skip."""
    from cpu_kernels import dispatch

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


@pytest.fixture(params=["torch", *[f"cpp-{i}" for i in _isas()]])
def backend(request, monkeypatch):
    """Every kernel path, the torch fallback too: for tests against a computation written apart."""
    yield from _select(request.param, monkeypatch)


@pytest.fixture(params=[f"cpp-{i}" for i in _isas()])
def cpp_backend(request, monkeypatch):
    """The C++ ISAs only: for tests against the torch fallback (cpu_kernels/reference.py), which its
    own tests check against attention written from its definition."""
    yield from _select(request.param, monkeypatch)


@pytest.fixture(scope="session")
def quick_expert_curve():
    """A function measuring the fused expert kernel's quick FLOP/s curve once a session (~10 s): the
    curve's own test and `moelight profile --quick` take the same measurement."""
    import copy

    from moelight.profiling.expert_kernel_curve import measure_expert_curve

    measured: list = []

    def curve(quick: bool = False):
        assert quick, "the suite measures the quick curve only"
        if not measured:
            # two layer copies: the rates' streaming over copies is test_profile_in_place's
            measured.append(measure_expert_curve(quick=True, stream_bytes=1))
        return copy.deepcopy(measured[0])

    return curve


@pytest.fixture
def bf16_packing_host(monkeypatch):
    """Plan as on a CPU whose oneDNN packs bf16 weights (AVX512-BF16 or AMX: the hosts whose measured peaks the
    memory tests hold), whatever this one packs: no strips or float32 copies of bf16 matmuls
    (cpu_linear.linear_form)."""
    from moelight.runtime import cpu_linear

    monkeypatch.setattr(cpu_linear, "packing_supported", lambda dtype: True)
