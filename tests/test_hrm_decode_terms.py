"""The HRM's decode terms beyond the GEMMs: the host's passes over a step's logits, and a profile that
lacks them being retaken."""

import json

import pytest

from hrm import HardwareSpec, Level, WorkloadSpec, costs, get_model
from hrm.hardware_checks import spec_problems
from optimizer import Policy, build_point_model, predict_job


def _level(**kw) -> Level:
    base = dict(name="c", memory_bytes=64 * 2**30, bandwidth=1e12, flops={"bfloat16": 256e9, "float32": 128e9})
    return Level(**(base | kw))


def test_a_step_pays_the_host_passes_over_its_logits():
    m, wl = get_model("bench-1b"), WorkloadSpec(85, 64, 130)
    free = HardwareSpec("h", _level())
    paid = HardwareSpec("h", _level(logits_bandwidth=1e10))
    assert costs.logits_passes_time(free, m, 256) == 0.0  # unmeasured (datasheet presets): free
    per_step = 256 * m.vocab_size * costs.LOGIT_PASS_BYTES / 1e10  # 256 rows x 32k logits x 14 bytes: ~11.5 ms
    assert costs.logits_passes_time(paid, m, 256) == pytest.approx(per_step)
    a = build_point_model(free, m, wl, "bfloat16", 128, 2, 0, 0)
    b = build_point_model(paid, m, wl, "bfloat16", 128, 2, 0, 0)
    assert float(b.decode_step_time(0, 0) - a.decode_step_time(0, 0)) == pytest.approx(per_step)  # all N rows once
    policy = Policy(256, 256, 1, False, False, 0.0, 0.0, "bfloat16")
    slow, fast = (predict_job(hw, m, wl, policy, 256) for hw in (paid, free))
    assert slow["decode_seconds"] - fast["decode_seconds"] == pytest.approx(63 * per_step)


def test_the_logits_rate_roundtrips_scales_and_is_checked(tmp_path):
    hw = HardwareSpec("p", _level(logits_bandwidth=7e9))
    assert HardwareSpec.load(hw.save(tmp_path / "p.json")).cpu.logits_bandwidth == 7e9
    assert hw.cpu.scaled(2).logits_bandwidth == 1.4e10
    assert any("logits_bandwidth" in p for p in spec_problems(HardwareSpec("p", _level(logits_bandwidth=-1.0))))


def test_a_cached_cpu_profile_without_the_logits_rate_is_retaken(tmp_path):
    from moelight.planning.hardware_choice import _profile_is_stale
    from tests.current_profile import save_current_profile

    path = save_current_profile(tmp_path / "hardware.json")
    assert not _profile_is_stale(path)
    d = json.loads(path.read_text())
    del d["cpu"]["logits_bandwidth"]  # written before the profile measured the in-place terms
    path.write_text(json.dumps(d))
    assert _profile_is_stale(path)
