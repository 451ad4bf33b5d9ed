"""A job's prediction says how old the profile behind it is: the host's speed drifts, and a prediction
from an old profile misses by that drift (BENCHMARKS §20)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from hrm import hardware_presets
from hrm.hardware import HardwareSpec
from moelight.jobs.report import RunReport, profile_age_text
from moelight.planning.hardware_choice import _profile_is_stale, resolve_hardware
from moelight.profiling import machine_profile
from tests.current_profile import save_current_profile
from tests.test_profile_host_load import _fake_measurements

NOW = datetime(2026, 11, 30, 3, 12, tzinfo=timezone.utc)


@pytest.mark.parametrize("measured_at, text", [
    ("2026-11-30T00:00:00+00:00", ", from a profile measured 3.2 h ago"),
    ("2026-11-30T03:10:30+00:00", ", from a profile measured 1.5 min ago"),
    ("2026-11-28T03:12:00", ", from a profile measured 2.0 d ago"),  # no zone: UTC, as profiles are written
    ("2026-11-30T03:11:50+00:00", ", from a profile measured just before the job"),
    ("", ""), ("last tuesday", ""),  # a preset, or a hand-edited time: nothing to say
])
def test_the_age_of_a_profile(measured_at, text):
    assert profile_age_text(measured_at, NOW) == text


def test_a_profile_records_when_it_was_measured_and_keeps_it_through_its_file(monkeypatch, tmp_path):
    _fake_measurements(monkeypatch, 0.1)
    before = datetime.now(timezone.utc).replace(microsecond=0)
    hw = machine_profile.profile_machine(quick=True)
    assert before <= datetime.fromisoformat(hw.measured_at) <= datetime.now(timezone.utc)
    assert resolve_hardware(str(hw.save(tmp_path / "hw.json"))).measured_at == hw.measured_at
    assert hardware_presets.get_hardware("t4").measured_at == ""  # a preset was never measured


def test_a_profile_with_a_time_that_is_not_text_is_refused():
    d = replace(hardware_presets.get_hardware("t4"), measured_at="").to_dict() | {"measured_at": 5}
    with pytest.raises(ValueError, match="measured_at"):
        HardwareSpec.from_dict(d)


def test_the_report_prints_the_age_beside_the_prediction():
    when = (datetime.now(timezone.utc) - timedelta(hours=5)).isoformat(timespec="seconds")
    report = RunReport(model="m", dtype="bfloat16", requests=1, batch_size=1, micro_batch_size=1,
                       policy={"hardware_measured_at": when}, prediction={"end_to_end_tokens_per_s": 10.0})
    assert "tok/s end-to-end (HRM, from a profile measured 5.0 h ago)" in report.summary()
    report.policy = {}
    assert "tok/s end-to-end (HRM)" in report.summary()


def test_the_plan_carries_the_profiles_time_to_the_report(tmp_path):
    from moelight.engine.options import EngineOptions
    from moelight.loading.presets import PRESETS
    from moelight.planning.job_plan import plan_job
    from moelight.sampling.params import SamplingParams

    path = replace(hardware_presets.get_hardware("t4"), measured_at="2026-11-30T00:00:00+00:00").save(
        tmp_path / "hw.json")
    prompts, params = [[1, 2, 3]] * 4, [SamplingParams(max_tokens=4)] * 4
    job = plan_job(EngineOptions(model="mixtral-8x7b", hardware=str(path), enable_prefix_caching=False),
                   PRESETS["mixtral-8x7b"], "float16", prompts, params, "emulated")
    assert job.info["hardware_measured_at"] == "2026-11-30T00:00:00+00:00"
    assert "hardware_measured_at" not in plan_job(
        EngineOptions(model="mixtral-8x7b", hardware="t4", enable_prefix_caching=False),
        PRESETS["mixtral-8x7b"], "float16", prompts, params, "emulated").info


@pytest.mark.parametrize("older", ["measured_at", "kv_first_touch_bandwidth"])
def test_a_cached_profile_from_before_its_time_and_first_touch_rate_is_retaken(tmp_path, older):
    """Without them the report cannot say the profile's age and prefill pays no page faults: taken again."""
    import json

    path = save_current_profile(tmp_path / "hardware.json")
    assert not _profile_is_stale(path)
    d = json.loads(path.read_text())
    del (d["cpu"] if older in d["cpu"] else d)[older]
    path.write_text(json.dumps(d))
    assert _profile_is_stale(path)
