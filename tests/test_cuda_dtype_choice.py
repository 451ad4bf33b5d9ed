"""The dtype a CUDA job runs in: float16 where the GPU has no bfloat16 arithmetic and the dtype was
left to moelight, a warning where the user asked for bfloat16 there, nothing on Ampere and later."""

from __future__ import annotations

import torch

from moelight.planning.hardware_choice import cuda_dtype_advice


def test_gpus_without_bfloat16_run_float16_when_the_dtype_is_auto():
    dtype, note = cuda_dtype_advice("auto", "bfloat16", (7, 5))
    assert dtype == "float16" and "sm_75" in note and "--dtype float32" in note
    dtype, note = cuda_dtype_advice("bfloat16", "bfloat16", (7, 0))
    assert dtype is None and "slowly" in note
    assert cuda_dtype_advice("auto", "bfloat16", (8, 0)) == (None, "")
    assert cuda_dtype_advice("auto", "float32", (7, 5)) == (None, "")


def test_a_session_on_a_t4_class_gpu_loads_float16(monkeypatch):
    import moelight.engine.session as session_module
    from moelight.engine.options import EngineOptions

    monkeypatch.setattr(session_module, "resolve_device", lambda name: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    logged = []
    session = session_module.EngineSession(EngineOptions("tiny", load_format="dummy", device="cuda"), log=logged.append)
    assert session.dtype_name == "float16" and session.source.dtype == torch.float16
    assert any("no bfloat16 arithmetic" in line for line in logged)


def test_a_schedule_that_device_auto_leaves_unused_on_a_host_without_a_gpu_is_said(monkeypatch):
    from moelight.engine import session as session_module
    from moelight.engine.options import EngineOptions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    logged: list[str] = []
    session_module.EngineSession(EngineOptions("tiny", load_format="dummy", schedule="flexgen"), log=logged.append)
    assert any("--schedule flexgen is unused: --device auto found no GPU" in line for line in logged), logged
    logged.clear()
    session_module.EngineSession(EngineOptions("tiny", load_format="dummy"), log=logged.append)
    assert not any("--schedule" in line for line in logged)
