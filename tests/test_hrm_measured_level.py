"""Measured-level terms: the GEMM curve by row count, attention kernel speeds, overheads."""

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hrm import HardwareSpec, Level, WorkloadSpec, costs, get_model
from hrm import operators as ops
from optimizer import Policy, build_point_model, predict_job

CURVE = [[1, 1e9], [16, 16e9], [256, 256e9]]


def _level(**kw) -> Level:
    base = dict(name="c", memory_bytes=64 * 2**30, bandwidth=1e12,
                flops={"bfloat16": 256e9, "float32": 128e9})
    return Level(**(base | kw))


def test_gemm_peak_interpolates_in_log_m_and_clamps():
    lvl = _level(gemm_flops={"bfloat16": CURVE})
    assert lvl.gemm_peak("bf16", 16) == pytest.approx(16e9)
    assert lvl.gemm_peak("bfloat16", 4) == pytest.approx(8.5e9)  # halfway in log M between 1 and 16
    assert lvl.gemm_peak("bfloat16", 0.5) == pytest.approx(1e9)
    assert lvl.gemm_peak("bfloat16", 4096) == pytest.approx(256e9)
    assert np.allclose(lvl.gemm_peak("bfloat16", np.array([1.0, 256.0])), [1e9, 256e9])
    assert lvl.gemm_peak("bfloat16", None) == 256e9  # not a GEMM: the plain peak
    assert lvl.gemm_peak("float32", 4) == 128e9  # no curve for the dtype: its plain peak


def test_op_time_uses_gemm_rows_and_attention_kernel_speeds():
    m = get_model("bench-1b")
    hw = HardwareSpec("h", _level(gemm_flops={"bfloat16": CURVE}, attention_bandwidth=1e9))
    flat = HardwareSpec("h", _level())
    head = ops.lm_head(m, 1, 2.0)
    assert costs.lm_head_time(hw, m, 1, "cpu") == pytest.approx(float(head.flops) / 1e9)
    assert costs.lm_head_time(hw, m, 1, "cpu") > 100 * costs.lm_head_time(flat, m, 1, "cpu")
    att = ops.decode_attention(m, 4, 100, 2.0)
    assert costs.attention_time(hw, m, 4, 100, "cpu") == pytest.approx(float(att.bytes) / 1e9)
    ffn = ops.moe_ffn(m, 8, 2.0)  # 8 tokens x top-2 over ~6.6 touched experts: ~2.4 rows per expert
    assert 1.0 < float(ffn.rows) < 3.0


def test_overheads_enter_the_cost_model_per_micro_batch():
    m, wl = get_model("bench-1b"), WorkloadSpec(77, 16, 418)
    quiet = HardwareSpec("h", _level())
    busy = HardwareSpec("h", _level(layer_overhead_s=1e-3, step_overhead_s=2e-3))
    a = build_point_model(quiet, m, wl, "bfloat16", 8, 3, 0, 0)
    b = build_point_model(busy, m, wl, "bfloat16", 8, 3, 0, 0)
    step = float(b.decode_step_time(0, 0) - a.decode_step_time(0, 0))
    assert step == pytest.approx(3 * (m.num_layers * 1e-3 + 2e-3))


def test_measured_fields_roundtrip_and_old_profiles_still_load(tmp_path):
    hw = HardwareSpec("p", _level(gemm_flops={"bfloat16": CURVE}, attention_bandwidth=5e9,
                                  attention_flops={"bfloat16": 5e10}, layer_overhead_s=1e-4,
                                  elementwise_bandwidth=3e10))
    back = HardwareSpec.load(hw.save(tmp_path / "hw.json"))
    assert back == hw
    old = {"name": "p",
           "cpu": {"name": "c", "memory_bytes": 1e9, "bandwidth": 1e10, "flops": {"float32": 1e11}}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    lvl = HardwareSpec.load(tmp_path / "old.json").cpu
    assert lvl.gemm_flops == {} and lvl.layer_overhead_s == 0.0 and lvl.gemm_peak("float32", 4) == 1e11
    assert lvl.elementwise_bandwidth == 0.0


def test_predict_job_sums_batches():
    m, wl = get_model("bench-1b"), WorkloadSpec(100, 10, 200)
    hw = HardwareSpec("h", _level(gemm_flops={"bfloat16": CURVE}))
    pol = Policy(8, 4, 2, False, False, 0.0, 0.0)
    one = predict_job(hw, m, wl, pol, 8)
    two = predict_job(hw, m, wl, pol, 16)
    assert two["batches"] == 2 and two["generation_seconds"] == pytest.approx(2 * one["generation_seconds"])
    assert two["end_to_end_tokens_per_s"] == pytest.approx(one["end_to_end_tokens_per_s"])
    ragged = predict_job(hw, m, wl, pol, 10)  # a batch of 8 and one of 2
    assert ragged["batches"] == 2 and ragged["end_to_end_tokens_per_s"] < one["end_to_end_tokens_per_s"]


def test_predicted_prefill_rate_counts_the_positions_prefill_computes():
    """A shared prefix is computed once: the predicted prefill rate is computed positions per second,
    as the run report's measured one is, not every prompt token over the shorter prefill."""
    m = get_model("bench-1b")
    hw = HardwareSpec("h", _level(gemm_flops={"bfloat16": CURVE}))
    pol = Policy(8, 4, 2, False, False, 0.0, 0.0)
    shared = predict_job(hw, m, WorkloadSpec(100, 10, 200, shared_prefix=60.0), pol, 8)
    assert shared["prefill_tokens_per_s"] == pytest.approx(8 * 40 / shared["prefill_seconds"])


def test_profile_gemm_curve_is_measured_with_the_engine_kernel():
    torch = pytest.importorskip("torch")
    from moelight.profiling.machine_profile import measure_gemm_curve

    curve = measure_gemm_curve(torch.float32, rows=(1, 8), pool_bytes=2**20, repeat=1)
    assert [m for m, _ in curve] == [1.0, 8.0] and all(f > 0 for _, f in curve)


def test_the_moe_ffn_runs_at_the_expert_kernels_rate_where_one_is_measured(tmp_path):
    """The fused CPU expert kernel's curve prices the routed experts; the GEMM curve the rest, and the
    experts too where no expert curve was measured (old profiles, GPUs, no C++ kernels)."""
    m = get_model("bench-1b")
    fast = [[1, 4e9], [16, 64e9], [256, 1024e9]]  # 4x the GEMM curve
    plain = _level(gemm_flops={"bfloat16": CURVE})
    lvl = _level(gemm_flops={"bfloat16": CURVE}, expert_gemm_flops={"bfloat16": fast})
    assert lvl.expert_peak("bfloat16", 16) == pytest.approx(64e9) and plain.expert_peak("bfloat16", 16) == 16e9
    assert lvl.expert_peak("float32", 16) == lvl.gemm_peak("float32", 16)  # no curve for the dtype
    ffn = ops.moe_ffn(m, 256, 2.0)
    assert float(costs.moe_ffn_time(m, 256, plain, "bfloat16")) == pytest.approx(
        4 * float(costs.moe_ffn_time(m, 256, lvl, "bfloat16")))
    assert float(costs.moe_ffn_time(m, 256, plain, "bfloat16")) == pytest.approx(
        float(ffn.flops) / float(plain.gemm_peak("bfloat16", ffn.rows)))
    assert costs.lm_head_time(HardwareSpec("h", lvl), m, 4, "cpu") == costs.lm_head_time(HardwareSpec("h", plain), m, 4,
                                                                                        "cpu")
    assert float(costs.expert_time(m, 16, lvl, "bfloat16")) == pytest.approx(
        float(ops.expert_ffn(m, 16, 2.0).flops) / 64e9)
    assert HardwareSpec.load(HardwareSpec("p", lvl).save(tmp_path / "hw.json")).cpu == lvl
    assert lvl.scaled(2).expert_peak("bfloat16", 16) == pytest.approx(128e9)


def test_quantized_experts_run_at_their_formats_rate_where_one_is_measured():
    """int4 experts multiply on int8 activations, faster than bf16 ones on AVX2: a model whose experts are
    held as uint4 is priced by that format's curve, other formats (and old profiles) by the dtype's."""
    m = get_model("bench-1b")
    bf16, u4 = [[1, 4e9], [256, 1024e9]], [[1, 8e9], [256, 1536e9]]
    lvl = _level(gemm_flops={"bfloat16": CURVE}, expert_gemm_flops={"bfloat16": bf16, "uint4": u4})
    held = replace(m, expert_bits=4.5, expert_format="uint4")
    assert lvl.expert_peak("bfloat16", 256, "uint4") == pytest.approx(1536e9)
    assert lvl.expert_peak("bfloat16", 256, "fp8") == pytest.approx(1024e9)  # not measured: bf16's
    assert float(costs.moe_ffn_time(m, 1024, lvl, "bfloat16")) == pytest.approx(
        1.5 * float(costs.moe_ffn_time(held, 1024, lvl, "bfloat16")))
    assert float(costs.expert_time(held, 256, lvl, "bfloat16")) == pytest.approx(
        float(ops.expert_ffn(held, 256, 2.0).flops) / 1536e9)


def test_profile_measures_the_fused_expert_kernel(quick_expert_curve):
    pytest.importorskip("torch")
    from cpu_kernels import kernel_backend

    curve = quick_expert_curve(quick=True)  # measure_expert_curve(quick=True), shared with the profile test
    if kernel_backend() == "torch":
        assert curve == {}
        return
    assert set(curve) == {"bfloat16", "int8", "uint4", "mxfp4"}
    for points in curve.values():
        assert [m for m, _ in points] == [1.0, 16.0, 64.0, 256.0] and all(f > 0 for _, f in points)


def test_elementwise_bytes_by_hand():
    m = get_model("tiny")  # h=64 f=128 E=4 k=2 Hq=4 Hkv=2 d=16: q_dim 64, kv_dim 32
    assert float(ops.rmsnorm_bytes(10, 2.0)) == 10 * (6 + 8 + 4 + 8 + 6 + 4)  # bf16: 36 per element
    assert float(ops.rmsnorm_bytes(10, 4.0)) == 10 * 28  # float32: no casts
    pre = ops.pre_attention_elementwise(m, 3, 2.0)
    assert float(pre.bytes) == 3 * 64 * 36 + 10 * 3 * (64 + 32) * 2
    post = ops.post_attention_elementwise(m, 3, 2.0)
    pair = (2 * 64 + 5 * 128 + 2 * 64 + 3 * 64) * 2 + 8 * 64  # gather, SiLU*up, scale+round, scatter
    assert float(post.bytes) == 3 * 64 * 36 + 4 * 3 * 64 * 2 + 2 * 3 * pair
    assert float(pre.flops) == 0.0


def test_elementwise_time_only_where_measured():
    m = get_model("bench-1b")
    datasheet = HardwareSpec("h", _level())
    measured = HardwareSpec("h", _level(elementwise_bandwidth=2e10))
    for part, ew in ((costs.pre_attention_time, ops.pre_attention_elementwise),
                     (costs.post_attention_time, ops.post_attention_elementwise)):
        extra = part(measured, m, 64, "cpu") - part(datasheet, m, 64, "cpu")
        assert extra == pytest.approx(float(ew(m, 64, 2.0).bytes) / 2e10)
    both = float(ops.pre_attention_elementwise(m, 2 * 77, 2.0).bytes
                 + ops.post_attention_elementwise(m, 2 * 77, 2.0).bytes)
    extra = costs.prefill_layer_time(measured, m, 2, 77, "cpu") - costs.prefill_layer_time(datasheet, m, 2, 77, "cpu")
    assert extra == pytest.approx(both / 2e10)
    assert measured.cpu.scaled(2).elementwise_bandwidth == 4e10


def test_copy_cost_fit_and_the_staging_rate_are_measured():
    from moelight.profiling.gpu_profile import fit_copy_cost, measure_staging

    sizes = [1e5, 1e6, 1e7, 1e8]
    fixed, rate = fit_copy_cost(sizes, [10e-6 + s / 12e9 for s in sizes])
    assert fixed == pytest.approx(10e-6, rel=1e-3) and rate == pytest.approx(12e9, rel=1e-3)
    assert fit_copy_cost([1e6, 2e6], [1e-4, 2e-4])[0] == pytest.approx(0.0, abs=1e-9)
    staging = measure_staging(quick=True)
    assert 1e8 < staging < 1e12  # a plausible host copy rate, bytes/s
    hw = HardwareSpec("p", _level(), staging_bandwidth=staging)
    assert HardwareSpec.load(hw.save(Path(tempfile.mkdtemp()) / "hw.json")).staging_rate() == staging
