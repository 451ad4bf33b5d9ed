"""The host's work per sequence in a decode step: measured by `moelight profile`, charged by the HRM
to every decode step (throughput and latency mode), and a profile without it is retaken."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hrm import WorkloadSpec, costs, get_hardware, get_model
from optimizer.cost_model import build_point_model
from optimizer.latency_mode import predict_latency_mode

MIX = get_model("mixtral-8x7b")
WL = WorkloadSpec(77, 128, 418)


def _with_host_cost(hw, seconds: float):
    return dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, sequence_step_s=seconds))


def test_every_decode_step_pays_the_host_work_of_each_of_its_sequences():
    hw = get_hardware("s1")
    mu, n = 36, 14
    base = build_point_model(hw, MIX, WL, "float16", mu, n, 0, 1)
    host = build_point_model(_with_host_cost(hw, 50e-6), MIX, WL, "float16", mu, n, 0, 1)
    assert float(costs.sequence_step_time(_with_host_cost(hw, 50e-6), mu * n)) == pytest.approx(mu * n * 50e-6)
    assert float(host.head_dec) - float(base.head_dec) == pytest.approx(mu * n * 50e-6)
    assert float(host.head_pre) - float(base.head_pre) == pytest.approx(mu * n * 50e-6)
    # the layers' own terms do not change
    assert {k: float(v) for k, v in host.layer_times(0.0, 0.0).items()} == \
        {k: float(v) for k, v in base.layer_times(0.0, 0.0).items()}


def test_latency_mode_steps_pay_it_too():
    hw = get_hardware("t4")
    base = predict_latency_mode(hw, MIX, WL, 64, 16, "float16", hit_rate=1.0, slots=MIX.num_experts * 2)
    host = predict_latency_mode(_with_host_cost(hw, 1e-3), MIX, WL, 64, 16, "float16", hit_rate=1.0,
                                slots=MIX.num_experts * 2)
    assert host.step_seconds - base.step_seconds == pytest.approx(16 * 1e-3)


def test_the_profile_measures_a_positive_cost_per_sequence():
    """A model without layers decodes 32 and 256 sequences through the engine: its steps grow with the
    batch (sampling, block tables, bookkeeping), at well under a millisecond per sequence."""
    import moelight.engine  # noqa: F401  (lends the profile its probe)
    from moelight.profiling.sequence_step import measure_sequence_step

    s = measure_sequence_step(quick=True)
    assert 1e-9 < s < 1e-3


def test_a_cached_profile_without_it_is_retaken(tmp_path):
    from moelight.planning.hardware_choice import _profile_is_stale
    from tests.current_profile import save_current_profile

    path = save_current_profile(tmp_path / "hardware.json")
    assert not _profile_is_stale(path)
    d = json.loads(path.read_text())
    for old in (None, 0.0):  # written before the HRM charged it, or by a profile run without the engine
        if old is None:
            del d["cpu"]["sequence_step_s"]
        else:
            d["cpu"]["sequence_step_s"] = old
        path.write_text(json.dumps(d))
        assert _profile_is_stale(path)
