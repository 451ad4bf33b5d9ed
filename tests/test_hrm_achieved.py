"""The HRM's achieved-rate terms against hand computations, and monotonicity with them."""

import dataclasses

import pytest

from hrm import WorkloadSpec, costs, get_hardware, get_model
from hrm import operators as ops
from hrm.hardware import GB, HardwareSpec, Level, Link
from hrm.hardware_presets import T4, T4_LINK, datasheet_variant
from optimizer import evaluate_policy, plan
from optimizer.cost_model import build_point_model
from optimizer.policy import Policy

MIX = get_model("mixtral-8x7b")
PADDED = WorkloadSpec(77, 128, 418, padded=True)


def test_a_copy_pays_its_fixed_cost_and_moves_bytes_at_the_pinned_or_pageable_rate():
    link = Link(h2d=12e9, d2h=10e9, pageable_h2d=6e9, latency_s=10e-6)
    assert link.copy_seconds(12e6, "h2d") == pytest.approx(10e-6 + 1e-3)
    assert link.copy_seconds(12e6, "h2d", copies=3) == pytest.approx(30e-6 + 1e-3)
    assert link.copy_seconds(6e6, "h2d", pinned=False) == pytest.approx(10e-6 + 1e-3)
    assert link.rate("d2h", pinned=False) == 5e9  # no pageable rate given: half the pinned one
    with pytest.raises(ValueError, match="direction"):
        link.rate("sideways")
    hw = HardwareSpec("h", T4, T4, 1, link)
    assert costs.transfer_time(hw, 10e6, "d2h", copies=2) == pytest.approx(20e-6 + 1e-3)


def test_the_staging_hop_runs_at_the_runtimes_copy_rate_or_half_the_host_bandwidth():
    cpu = Level("c", 1e11, 40e9, {"float32": 1e12})
    hw = HardwareSpec("h", cpu, T4, 1, T4_LINK)
    assert hw.staging_rate() == 20e9  # a copy reads and writes every byte
    assert costs.staging_time(hw, 2e9) == pytest.approx(0.1)
    fast = dataclasses.replace(hw, staging_bandwidth=50e9)
    assert costs.staging_time(fast, 2e9) == pytest.approx(0.04)


def test_a_gemm_streams_its_weights_at_the_gemm_bandwidth_other_kernels_at_the_copy_rate():
    gpu = Level("g", 1e10, 200e9, {"float16": 20e12}, gemm_bandwidth=80e9)
    gemm = ops.OpCost(flops=1e9, bytes=1e9, rows=4)
    assert costs.op_time(gemm, gpu, "float16") == pytest.approx(1e9 / 80e9)
    other = ops.OpCost(flops=1e9, bytes=1e9)
    assert costs.op_time(other, gpu, "float16") == pytest.approx(1e9 / 200e9)
    big = ops.OpCost(flops=1e13, bytes=1e9, rows=4096)  # compute-bound: the FLOP/s roof wins
    assert costs.op_time(big, gpu, "float16") == pytest.approx(0.5)
    assert gpu.scaled(2).gemm_bandwidth == 160e9


def test_the_t4_preset_carries_the_sourced_rates():
    # FlexGen's GCP-T4 fit: decode matmul 4.3 TFLOPS at 48 rows = 48 FLOP per fp16 weight byte
    assert T4.gemm_bandwidth == pytest.approx(4.3e12 / 48, rel=1e-3)
    assert T4.flops["float16"] == 21.24e12 and T4.bandwidth == 220 * GB  # FlexGen prefill; Jia et al.
    assert T4_LINK.h2d == 12.89 * GB
    peak = datasheet_variant(get_hardware("s1"))
    assert peak.gpu.bandwidth == 320 * GB and peak.link.h2d == 16 * GB and peak.gpu.gemm_bandwidth == 0


def test_prefill_streams_weights_once_per_batch_layer_major_or_once_per_chunk():
    layer_major = WorkloadSpec(400, 16, 400)
    assert float(layer_major.prefill_passes(36, 14)) == 14
    assert float(layer_major.prefill_weight_loads(36, 14)) == 1
    chunked = dataclasses.replace(layer_major, prefill_chunk=4096)  # 10 prompts of 400 per pass
    assert float(chunked.prefill_passes(36, 14)) == 14 * 4
    assert float(chunked.prefill_weight_loads(36, 14)) == 56
    with pytest.raises(ValueError, match="prefill_chunk"):
        WorkloadSpec(10, 1, prefill_chunk=0)


def test_cost_model_terms_by_hand_on_s1():
    hw = get_hardware("s1")
    pm = build_point_model(hw, MIX, PADDED, "float16", 36, 14, 0, 1)
    w_le = costs.layer_expert_bytes(MIX, "float16")
    lt = {k: float(v) for k, v in pm.layer_times(0.0, 0.0).items()}
    assert lt["T_stage"] == pytest.approx(w_le / hw.staging_rate())
    # H2D: every paged byte, the attention outputs, and the fixed cost of 2 copies per micro-batch
    out = float(costs.attention_output_bytes(MIX, 36 * 14, "float16"))
    assert lt["T_h2d"] == pytest.approx((w_le + out) / 12.89e9 + 14 * 2 * 10e-6)
    # GPU: per micro-batch the experts stream at FlexGen's rate, plus the pass overhead
    per_mb = (costs.pre_attention_time(hw, MIX, 36, "gpu", "float16")
              + costs.post_attention_time(hw, MIX, 36, "gpu", "float16") + 0.5e-3)
    assert lt["T_gpu"] == pytest.approx(14 * per_mb)
    assert w_le / T4.gemm_bandwidth < per_mb < 1.1 * w_le / T4.gemm_bandwidth
    # prefill: one weight stream per batch (layer-major), compute per micro-batch
    chunked = dataclasses.replace(PADDED, prefill_chunk=4096)  # 9 prompts of 418 per pass: 4 passes each
    pc = build_point_model(hw, MIX, chunked, "float16", 36, 14, 0, 1)
    assert float(pc.pre_h2d.at(0, 0)) - float(pm.pre_h2d.at(0, 0)) == pytest.approx(55 * w_le / 12.89e9)


@pytest.mark.parametrize("change", ["gpu_bw", "gemm_bw", "link", "latency", "staging", "host", "gpu_mem", "cpu_mem"])
def test_more_of_any_resource_never_predicts_slower(change):
    hw = get_hardware("s1")
    g, c, lk = hw.gpu, hw.cpu, hw.link
    better = {
        "gpu_bw": lambda: dataclasses.replace(hw, gpu=dataclasses.replace(g, bandwidth=g.bandwidth * 1.5)),
        "gemm_bw": lambda: dataclasses.replace(hw, gpu=dataclasses.replace(g, gemm_bandwidth=g.gemm_bandwidth * 2)),
        "link": lambda: dataclasses.replace(hw, link=dataclasses.replace(lk, h2d=lk.h2d * 2, d2h=lk.d2h * 2)),
        "latency": lambda: dataclasses.replace(hw, link=dataclasses.replace(lk, latency_s=0.0)),
        "staging": lambda: dataclasses.replace(hw, staging_bandwidth=hw.staging_rate() * 4),
        "host": lambda: dataclasses.replace(hw, host_bandwidth=c.bandwidth * 3),
        "gpu_mem": lambda: dataclasses.replace(hw, gpu=dataclasses.replace(g, memory_bytes=g.memory_bytes * 1.5)),
        "cpu_mem": lambda: dataclasses.replace(hw, cpu=dataclasses.replace(c, memory_bytes=c.memory_bytes * 1.5)),
    }[change]()
    grid = dict(mu_grid=[8, 36, 64, 128, 220], n_grid=[1, 3, 6, 14])
    base = plan(hw, MIX, PADDED, "float16", family="cgopipe", verify_with_pulp=False, **grid).e2e_tok_s
    more = plan(better, MIX, PADDED, "float16", family="cgopipe", verify_with_pulp=False, **grid).e2e_tok_s
    assert more >= base * (1 - 1e-9)
    fixed = Policy(504, 36, 14, False, True, 0.0, 0.0, "float16")
    assert evaluate_policy(better, MIX, PADDED, fixed).e2e_tok_s >= evaluate_policy(hw, MIX, PADDED, fixed).e2e_tok_s
