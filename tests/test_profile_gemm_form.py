"""A profile records the form its bf16 GEMM curve measured (runtime/cpu_linear's linear_form), and a cached
profile measured on another form than the engine here holds its weights in is retaken: its curve prices
matmuls this engine does not run."""

from __future__ import annotations

import json

import pytest

from moelight.planning.hardware_choice import _profile_is_stale
from moelight.profiling import machine_profile
from tests.current_profile import save_current_profile


def test_measure_cpu_records_the_form_of_the_weights_it_measured(monkeypatch):
    pytest.importorskip("torch")
    stub = {"measure_gemm_curve": lambda dt, rows, pool: [[1.0, 1e9], [1024.0, 1e11]],
            "measure_attention": lambda dt, quick: (1e10, 1e11), "measure_overheads": lambda dt, quick: (1e-4, 1e-4),
            "measure_sequence_step": lambda quick: 4e-5, "measure_expert_curve": lambda quick: {},
            "measure_logits_passes": lambda quick: 1e10, "measure_kv_first_touch": lambda quick: 2e9,
            "measure_layer_glue": lambda dt, quick, toy: (1e-4, 2e10)}
    for name, fn in stub.items():
        monkeypatch.setattr(machine_profile, name, fn)
    level = machine_profile.measure_cpu(quick=True)
    assert level.gemm_form == machine_profile.bf16_gemm_form()
    assert level.gemm_form in ("packed", "strips", "float32", "dense")


def _cached(tmp_path, form):
    path = save_current_profile(tmp_path / "hardware.json")
    d = json.loads(path.read_text())
    if form is None:
        del d["cpu"]["gemm_form"]
    else:
        d["cpu"]["gemm_form"] = form
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("here, recorded, stale", [
    ("strips", "strips", False), ("packed", "packed", False),
    ("strips", "float32", True),   # measured on float32 copies (another host, or before the strips)
    ("packed", "strips", True),    # copied from an AVX2 host to one where oneDNN packs bf16
    ("strips", None, True),        # written before the form was recorded: it measured float32 copies
    ("packed", None, False), ("float32", None, False),  # the same form as today's
])
def test_a_profile_measured_on_another_form_is_retaken(monkeypatch, tmp_path, here, recorded, stale):
    path = _cached(tmp_path, recorded)
    monkeypatch.setattr(machine_profile, "bf16_gemm_form", lambda: here)
    assert _profile_is_stale(path) is stale


def test_moelight_profile_names_the_form_its_bf16_curve_measured():
    from moelight.cli.profile_cmd import _describe
    from tests.current_profile import current_profile, measured_cpu

    cpu = measured_cpu(gemm_flops={"bfloat16": [[1, 1e9]], "float32": [[1, 1e9]]}, gemm_form="strips")
    text = _describe(current_profile(cpu))
    assert "GEMM bfloat16 (strips, GFLOP/s" in text and "GEMM float32 (packed, GFLOP/s" in text


@pytest.mark.parametrize("form", ["strip", 3, None])
def test_a_profile_with_a_form_the_engine_never_uses_is_refused_by_its_field(form):
    from hrm import HardwareSpec
    from hrm.hardware_checks import GEMM_FORMS
    from tests.current_profile import current_profile

    assert machine_profile.bf16_gemm_form() in GEMM_FORMS
    d = current_profile().to_dict()
    d["cpu"]["gemm_form"] = form
    with pytest.raises(ValueError, match=r"cpu\.gemm_form must be one of"):
        HardwareSpec.from_dict(d)
