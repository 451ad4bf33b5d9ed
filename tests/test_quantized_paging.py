"""Quantized experts on the CGOPipe runtime (runtime/expert_stacks.py, pipeline/weight_pager.py).

The resident experts and the paged slots hold the experts' codes and scales (a quarter of the
16-bit bytes for int4), the link carries them so, and the device expands a layer's experts into
the run's dtype before its GEMMs. Checked on the strict emulated device:
- float32: the same greedy tokens and logits, pass by pass, as the runtime on a dense model whose
  experts hold the dequantized values (the expansion computes exactly those values);
- bfloat16: the CPU engine's quantized path (the fused kernel on the same codes) takes the same
  tokens, its logits within the two paths' bf16 rounding (the kernel rounds activations between its
  GEMMs, the device's torch GEMMs round differently: up to ~3% of the largest logit here), until
  a near tie (of two tokens, or of two experts for one sequence's token) parts the runs;
- the fault that swaps two paged experts is seen, and the device never exceeds the planned bytes.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import dequantize
from moelight.models.expert_format import quantize_format
from moelight.models.quantized_experts import QuantizedExperts, hold_experts_quantized
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams
from tests.runtime_check import assert_close_run_on_gpu, assert_same_run, run_job, swap_paged_experts
from tests.test_pipeline_executor import CFG, EXEC_KW
from tests.tp_helpers import random_model


def _quantized_pair(method: str, dtype: torch.dtype):
    """(a model holding its experts quantized, a dense model holding their dequantized values)."""
    dense = random_model(CFG, seed=3).to(dtype)
    form = quantize_format(method, (CFG.hidden_size, CFG.intermediate_size), 32)
    held = copy.deepcopy(dense)
    hold_experts_quantized(held, form)
    held.config = replace(CFG, expert_format=form)
    reference = copy.deepcopy(dense)
    with torch.no_grad():
        for layer, src, ref in zip(held.layers, dense.layers, reference.layers, strict=True):
            for name in ("gate_up_proj", "down_proj"):
                q = getattr(layer.mlp, name)
                q[()].copy_(getattr(src.mlp, name).detach().float())  # round-to-nearest, row by row
                getattr(ref.mlp, name).copy_(dequantize(q.matrix()))
    return held, reference


@pytest.fixture(scope="module")
def job():
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 14))] for _ in range(9)]
    params = [SamplingParams(max_tokens=3 + (k % 4) * 2, temperature=0.0, ignore_eos=True)
              for k in range(len(prompts))]
    return prompts, params


def _run(model, prompts, params, r_w: float, fault=None):
    """The job on the runtime, and what its device held: (run, paged bytes, quantized?, peak, planned)."""
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=r_w, **EXEC_KW)
    if fault:
        fault(ex.pager)
    try:
        run = run_job(model, ex, prompts, params, 9, 2, max_prefill_tokens=32)
        return run, ex.pager.paged_bytes, ex.pager.quantized, ex.device.memory_peak, ex.plan.total
    finally:
        ex.close()


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_float32_runtime_equals_the_dequantized_model(job, method):
    prompts, params = job
    held, reference = _quantized_pair(method, torch.float32)
    assert isinstance(held.layers[0].mlp.gate_up_proj, QuantizedExperts)
    got, paged, quantized, peak, planned = _run(held, prompts, params, r_w=0.5)
    ref, ref_paged, *_ = _run(reference, prompts, params, r_w=0.5)
    assert_same_run(got, ref, rtol=1e-5, atol=1e-5, what=f"{method} paged")
    share = {"int4": 0.2, "int8": 0.28}[method]  # (4 bits + a scale and an offset per 32, or 8 + 1 scale a row) / 32
    assert quantized and paged < share * ref_paged
    assert peak <= planned


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_on_a_gpu_the_paged_codes_expand_to_the_dequantized_model(job, method):
    """CUDA: the link carries codes and scales, the GPU expands them; the plain engine's run of the
    dense model of the dequantized values, within cuBLAS rounding."""
    prompts, params = job
    held, reference = _quantized_pair(method, torch.float32)
    kw = {k: v for k, v in EXEC_KW.items() if not k.endswith("bandwidth")}
    ex = PipelineExecutor(copy.deepcopy(held), "cgopipe", "cuda", r_w=0.5, **kw)
    try:
        got = run_job(ex.model, ex, prompts, params, 9, 2, max_prefill_tokens=32)
        assert ex.pager.quantized
    finally:
        ex.close()
    assert_close_run_on_gpu(got, run_job(reference, None, prompts, params, 9, 2, max_prefill_tokens=32),
                            what=f"{method} on the GPU")


def test_a_swapped_paged_expert_is_seen(job):
    prompts, params = job
    held, reference = _quantized_pair("int4", torch.float32)
    ref, *_ = _run(reference, prompts, params, r_w=0.5)
    got, *_ = _run(held, prompts, params, r_w=0.5, fault=swap_paged_experts)
    with pytest.raises(AssertionError):
        assert_same_run(got, ref, rtol=1e-5, atol=1e-5)


def test_bfloat16_runtime_takes_the_cpu_engine_s_tokens(job, monkeypatch):
    prompts, params = job
    # the CPU kernel on the bf16 path's numbers: its int8-activation decode path (AVX2) departs from them
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", False)
    held, _ = _quantized_pair("int4", torch.bfloat16)
    cpu = copy.deepcopy(held)
    pack_model(cpu)  # the fused CPU kernel on the same codes
    ref = run_job(cpu, None, prompts, params, 9, 2, max_prefill_tokens=32)
    got, *_ = _run(held, prompts, params, r_w=0.25)
    for n, ((kind, a), (_, b)) in enumerate(zip(got.logits, ref.logits, strict=False)):
        a, b = a.float(), b.float()
        scale = b.abs().max()
        apart = (a - b).abs().amax(-1) / scale > 3e-2
        if bool(apart.any()):  # a routing near-tie: rounding gave one sequence's token another expert
            assert int(apart.sum()) == 1 and a.shape[0] > 2, f"{kind} pass {n}: {int(apart.sum())} rows apart"
            return
        differ = a.argmax(-1) != b.argmax(-1)
        if bool(differ.any()):  # a near tie: the runs part here, later passes are not compared
            top2 = b[differ].topk(2, dim=-1).values
            assert bool(((top2[:, 0] - top2[:, 1]) < 6e-2 * scale).all()), f"{kind} pass {n}: a clear choice differs"
            return
    assert got.tokens == ref.tokens


def test_hrm_counts_quantized_expert_bytes_and_the_planner_predicts_the_gain():
    """Bytes per weight reach the operator model, the link and the GPU's expansion; on S1 / S2 the
    planner predicts int8 and int4 experts faster than 16-bit ones (the link binds there)."""
    from hrm import WorkloadSpec, costs, get_hardware, get_model
    from optimizer import plan

    m = get_model("mixtral-8x7b")
    form = quantize_format("int4", (m.hidden_size, m.intermediate_size))
    q = replace(m, expert_bits=form.expert_bits(m.hidden_size, m.intermediate_size))
    assert q.expert_bits == pytest.approx(4.5)
    assert costs.layer_expert_bytes(q, "float16") == pytest.approx(costs.layer_expert_bytes(m, "float16") * 4.5 / 16)
    wl = WorkloadSpec(77, 128)
    for hw_name in ("s1", "s2"):
        hw = get_hardware(hw_name)
        assert costs.expert_dequantize_time(hw, q, "float16") > 0 == costs.expert_dequantize_time(hw, m, "float16")
        tok_s = {}
        for method in ("none", "int8", "int4"):
            spec = m if method == "none" else replace(m, expert_bits=quantize_format(
                method, (m.hidden_size, m.intermediate_size)).expert_bits(m.hidden_size, m.intermediate_size))
            tok_s[method] = plan(hw, spec, wl, "float16").e2e_tok_s
        assert tok_s["none"] < tok_s["int8"] <= tok_s["int4"] * 1.01, (hw_name, tok_s)


@pytest.mark.parametrize("policy", ["lru", "combined"])
def test_latency_mode_caches_quantized_experts(job, policy):
    """Latency mode's slots hold the experts' bytes; the same tokens and logits as the cache over the
    dense model of the dequantized values (the combined policy also runs small misses on the CPU,
    expanded there)."""
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor
    from moelight.expert_cache.policy_registry import make_policy

    prompts, params = job
    held, reference = _quantized_pair("int4", torch.float32)
    runs, moved = [], []
    for model in (held, reference):
        ex = ExpertCacheExecutor(model, 5, make_policy(policy, CFG.num_layers, CFG.num_experts), "emulated",
                                 cpu_max_tokens=2)
        try:
            runs.append(run_job(model, ex, prompts, params, 9, 2, max_prefill_tokens=32))
            moved.append(ex.cache_stats.fetched_bytes)
        finally:
            ex.close()
    assert_same_run(runs[0], runs[1], rtol=1e-5, atol=1e-5, what=f"latency mode, {policy}")
    assert 0 < moved[0] < 0.2 * moved[1]
