"""The CGOPipe runtime with quantized experts on the emulated device, the fused dequant-GEMM forced
(MOELIGHT_DEQUANT_GEMM=fused: Triton's interpreter on the CPU tensors) against the expand path: the
same greedy tokens, the logits within the dtype's rounding, and neither the dense layer buffer nor
its share of the memory plan."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from moelight.models import fused_dequant  # noqa: E402
from moelight.sampling.params import SamplingParams  # noqa: E402
from tests.runtime_check import assert_close_run_on_gpu, assert_same_run  # noqa: E402
from tests.test_quantized_paging import _quantized_pair, _run  # noqa: E402


@pytest.fixture(scope="module")
def job():
    """Five prompts of 3-13 tokens, 2-4 new tokens each: prefill, decode and both micro-batches, kept
    short because Triton's interpreter runs every launch of the fused kernel in numpy."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 14))] for _ in range(5)]
    return prompts, [SamplingParams(max_tokens=2 + k % 3, temperature=0.0, ignore_eos=True) for k in range(5)]


@pytest.mark.parametrize("method,dtype", [("int4", torch.float32), ("int8", torch.float32),
                                          ("int4", torch.bfloat16)], ids=str)
def test_fused_runtime_takes_the_expand_path_s_tokens(job, monkeypatch, method, dtype):
    prompts, params = job
    held, _ = _quantized_pair(method, dtype)
    runs = {}
    for mode in ("expand", "fused"):
        monkeypatch.setenv(fused_dequant.MODE_ENV, mode)
        runs[mode] = _run(held, prompts, params, r_w=0.5)
    (fused, _, _, peak, planned), (expand, _, _, expand_peak, expand_planned) = runs["fused"], runs["expand"]
    if dtype == torch.float32:
        assert_same_run(fused, expand, rtol=1e-4, atol=1e-4, what=f"{method} fused")
    else:  # the paths round bf16 partial sums apart (max |dlogit| 0.10-0.30, mean 0.03-0.06): a near tie may flip
        assert_close_run_on_gpu(fused, expand, rtol=0.0, atol=0.4, what=f"{method} fused bf16")
    # the dense layer (E x 3hf values of the run's dtype) and the expansion's scratch are gone from both
    assert peak <= planned < expand_planned and peak < expand_peak


def test_the_planner_counts_the_path_the_gpu_takes():
    """A GPU profile that says fused_dequant: no dequantize pass in the layer's time, no dense layer in the
    GPU memory map, so the plan predicts at least the expand path's tok/s; the default is the expand path."""
    from dataclasses import replace

    from hrm import WorkloadSpec, costs, get_hardware, get_model
    from hrm.hardware import HardwareSpec
    from moelight.models.expert_format import quantize_format
    from optimizer import evaluate_policy, plan

    m = get_model("mixtral-8x7b")
    q = replace(m, expert_bits=quantize_format("int4", (m.hidden_size, m.intermediate_size)).expert_bits(
        m.hidden_size, m.intermediate_size))
    wl = WorkloadSpec(77, 128)
    for name in ("s1", "s2"):
        hw = get_hardware(name)
        assert not hw.gpu.fused_dequant
        fused_hw = replace(hw, gpu=replace(hw.gpu, fused_dequant=True))
        assert HardwareSpec.from_dict(fused_hw.to_dict()).gpu.fused_dequant
        dequant = [costs.expert_dequantize_time(h, q, "float16") for h in (hw, fused_hw)]
        assert dequant[0] > 0 == dequant[1]
        expand, fused = plan(hw, q, wl, "float16"), plan(fused_hw, q, wl, "float16")
        assert fused.e2e_tok_s >= expand.e2e_tok_s
        same = evaluate_policy(fused_hw, q, wl, expand.policy)
        assert expand.gpu_memory["dequantized_layer"] > 0 and "dequantized_layer" not in same.gpu_memory
        assert same.e2e_tok_s >= expand.e2e_tok_s


@pytest.mark.parametrize("policy", ["lru", "combined"])
def test_latency_mode_multiplies_the_slots_codes(job, monkeypatch, policy):
    """Latency mode's slots, fused: the per-expert loop's F.linear takes the slot's codes (no expanded
    expert buffer); the same tokens and logits as the expand path (float32)."""
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor
    from moelight.expert_cache.policy_registry import make_policy
    from tests.runtime_check import run_job
    from tests.test_pipeline_executor import CFG

    prompts, params = job
    held, _ = _quantized_pair("int4", torch.float32)
    runs, expanded = {}, {}
    for mode in ("expand", "fused"):
        monkeypatch.setenv(fused_dequant.MODE_ENV, mode)
        ex = ExpertCacheExecutor(held, 5, make_policy(policy, CFG.num_layers, CFG.num_experts), "emulated",
                                 cpu_max_tokens=2)
        try:
            runs[mode] = run_job(held, ex, prompts, params, 9, 2, max_prefill_tokens=32)
            expanded[mode] = ex.slots.gu is not None
        finally:
            ex.close()
    assert expanded == {"expand": True, "fused": False}
    assert_same_run(runs["fused"], runs["expand"], rtol=1e-4, atol=1e-4, what=f"latency mode, {policy}, fused")
