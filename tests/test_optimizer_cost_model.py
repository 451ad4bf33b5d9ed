"""The policy cost model (memory breakdown and per-layer split) against hand arithmetic."""

import pytest

from hrm import costs
from hrm.hardware import HardwareSpec, Level, Link
from hrm.model_presets import get_model
from hrm.workload import WorkloadSpec
from optimizer import Policy, evaluate_policy

TINY = get_model("tiny")  # h=64 f=128 L=2 E=4 k=2 Hq=4 Hkv=2 d=16 V=512
HW = HardwareSpec("synthetic", Level("cpu", 1e9, 5e10, {"bfloat16": 1e12}),
                  Level("gpu", 1e8, 1e11, {"bfloat16": 1e13}), 1, Link(h2d=1e10, d2h=5e9))
WL = WorkloadSpec(prompt_len=10, gen_len=6)  # context: max 16, mean 13


def test_cgopipe_policy_memory_by_hand():
    pol = Policy(8, 4, 2, attn_on_gpu=False, ffn_on_gpu=True, r_w=0.5, r_c=0.0, dtype="bfloat16")
    res = evaluate_policy(HW, TINY, WL, pol)
    w_le = 4 * 3 * 64 * 128 * 2  # one layer's experts, bytes
    non_exp = (2 * (64 * 128 + 64 * 64 + 2 * 64 + 64 * 4) + 2 * 512 * 64 + 64) * 2
    # a prefill pass of 4 x 10 tokens; per token: hidden x3, q + k + v + attention output, the router in
    # float32, then the grouped experts' GEMM phase: k rows of h + 4f, a group's k rows in float32
    per_token = (3 * 64 + 64 + 2 * 32 + 64) * 2 + 4 * 4 + max(2 * (64 + 4 * 128) * 2 + 4 * 2 * 64,
                                                             2 * 64 * (4 * 2 + 4))
    act = 4 * 10 * per_token + 4 * 512 * 4
    # prefill attention on the GPU: one group call of the 4 prompts' 10 x 10 scores per head and their
    # 10 keys' K and V (2 x 2 heads x 16), 24 bytes per element (hrm.attention_memory)
    scratch = 4 * 10 * (4 * 10 + 2 * 2 * 16) * 24
    assert res.gpu_memory == pytest.approx({
        "non_expert_weights": non_exp, "resident_experts": 0.5 * 2 * w_le,
        "paged_weight_buffers": 2 * 0.5 * w_le, "activations": act, "prefill_attention_scratch": scratch})
    assert res.cpu_memory == pytest.approx({
        "experts": 0.5 * 2 * w_le, "kv_cache": 8 * 16 * 2 * 32 * 2 * 2,
        "pinned_weight_pages": 2 * 0.5 * w_le / 2, "pinned_activations": 8 * 128 * 2 + 8 * 64 * 2})
    assert res.gpu_capacity == pytest.approx(0.9e8) and res.cpu_capacity == pytest.approx(0.9e9)


def test_cgopipe_policy_layer_split_by_hand():
    pol = Policy(8, 4, 2, attn_on_gpu=False, ffn_on_gpu=True, r_w=0.5, r_c=0.0, dtype="bfloat16")
    lt = evaluate_policy(HW, TINY, WL, pol).layer_times
    w_le = 4 * 3 * 64 * 128 * 2
    assert lt["T_h2d"] == pytest.approx((0.5 * w_le + 8 * 64 * 2) / 1e10)  # paged weights + attn output
    assert lt["T_d2h"] == pytest.approx(8 * 128 * 2 / 5e9)  # QKV of N tokens
    gpu_mb = costs.pre_attention_time(HW, TINY, 4, "gpu") + costs.post_attention_time(HW, TINY, 4, "gpu")
    assert lt["T_gpu"] == pytest.approx(2 * gpu_mb)
    assert lt["T_cpu"] == pytest.approx(2 * costs.attention_time(HW, TINY, 4, 13, "cpu"))
    assert lt["T_layer"] == pytest.approx(max(lt["T_h2d"], lt["T_d2h"], lt["T_gpu"], lt["T_cpu"]))


def test_flexgen_policy_moves_kv_and_keeps_rc_share():
    pol = Policy(8, 4, 2, attn_on_gpu=True, ffn_on_gpu=True, r_w=0.0, r_c=0.25, dtype="bfloat16")
    res = evaluate_policy(HW, TINY, WL, pol)
    w_le = 4 * 3 * 64 * 128 * 2
    kv_mean_layer = 8 * 13 * 2 * 32 * 2
    assert res.layer_times["T_h2d"] == pytest.approx((w_le + 0.75 * kv_mean_layer) / 1e10)
    assert res.layer_times["T_d2h"] == pytest.approx(0.75 * 8 * 2 * 32 * 2 / 5e9)  # new K/V written back
    kv_total = 8 * 16 * 2 * 32 * 2 * 2
    assert res.gpu_memory["kv_cache"] == pytest.approx(0.25 * kv_total)
    assert res.cpu_memory["kv_cache"] == pytest.approx(0.75 * kv_total)
    assert res.layer_times["T_cpu"] == 0.0


def test_end_to_end_throughput_formula():
    pol = Policy(8, 4, 2, attn_on_gpu=False, ffn_on_gpu=True, r_w=0.5, r_c=0.0, dtype="bfloat16")
    res = evaluate_policy(HW, TINY, WL, pol)
    total = res.prefill_time + (WL.gen_len - 1) * res.decode_step_time
    assert res.e2e_tok_s == pytest.approx(8 * 6 / total)
    assert res.decode_tok_s == pytest.approx(8 / res.decode_step_time)
    assert res.prefill_tok_s == pytest.approx(8 * 10 / res.prefill_time)
    # the head on the GPU, then each micro-batch's float32 logits over the link to the host sampler
    logits = 2 * HW.link.latency_s + 8 * TINY.vocab_size * 4 / HW.link.d2h
    assert costs.logits_to_host_time(HW, TINY, 8, copies=2) == pytest.approx(logits)
    head = 2 * costs.lm_head_time(HW, TINY, 4, "gpu") + logits
    assert res.decode_step_time == pytest.approx(2 * res.layer_times["T_layer"] + head)


def test_latency_mode_pays_the_gpus_dispatch_per_layer_pass_and_step():
    """A decode step of latency mode: each of its L layer passes costs the GPU level's measured
    dispatch, the step its fixed cost (without them a small model on a fast GPU was predicted at
    millions of tokens per second)."""
    import dataclasses

    from optimizer.latency_mode import predict_latency_mode

    base = predict_latency_mode(HW, TINY, WL, requests=8, batch=4, dtype="bfloat16", slots=8)
    gpu = dataclasses.replace(HW.gpu, layer_overhead_s=1e-3, step_overhead_s=5e-4)
    slow = predict_latency_mode(dataclasses.replace(HW, gpu=gpu), TINY, WL, requests=8, batch=4, dtype="bfloat16",
                                slots=8)
    assert slow.step_seconds - base.step_seconds == pytest.approx(TINY.num_layers * 1e-3 + 5e-4)
    assert slow.prefill_seconds - base.prefill_seconds == pytest.approx(2 * TINY.num_layers * 1e-3)  # 2 batches


def test_latency_mode_pays_its_logits_copy_to_the_host_sampler():
    """Each step's float32 logits cross one GPU's link: a slower link costs a step that much more."""
    import dataclasses

    from optimizer.latency_mode import predict_latency_mode

    base = predict_latency_mode(HW, TINY, WL, requests=8, batch=4, dtype="bfloat16", slots=8)
    link = dataclasses.replace(HW.link, d2h=HW.link.d2h / 2)
    slow = predict_latency_mode(dataclasses.replace(HW, link=link), TINY, WL, requests=8, batch=4,
                                dtype="bfloat16", slots=8)
    assert slow.step_seconds - base.step_seconds == pytest.approx(4 * TINY.vocab_size * 4 / HW.link.d2h)


def test_the_runtime_s_measured_cost_per_layer_pass_prices_the_throughput_plan_not_latency_mode():
    """A GPU's measured cost of a layer pass through the CGOPipe runtime (moelight profile) holds each
    micro-batch's GPU layer pass (it includes the kernel launches, so the larger of the two counts);
    latency mode's executor runs no lanes and keeps the kernel-launch term."""
    import dataclasses

    from optimizer.latency_mode import predict_latency_mode

    pol = Policy(8, 4, 2, attn_on_gpu=False, ffn_on_gpu=True, r_w=0.5, r_c=0.0, dtype="bfloat16")
    base = evaluate_policy(HW, TINY, WL, pol).layer_times["T_gpu"]
    gpu = dataclasses.replace(HW.gpu, layer_overhead_s=1e-4, runtime_layer_s=2e-3)
    hw = dataclasses.replace(HW, gpu=gpu)
    assert evaluate_policy(hw, TINY, WL, pol).layer_times["T_gpu"] == pytest.approx(base + 2 * 2e-3)
    launches_only = dataclasses.replace(HW, gpu=dataclasses.replace(HW.gpu, layer_overhead_s=1e-4))
    assert evaluate_policy(launches_only, TINY, WL, pol).layer_times["T_gpu"] == pytest.approx(base + 2 * 1e-4)
    slow = predict_latency_mode(hw, TINY, WL, requests=8, batch=4, dtype="bfloat16", slots=8)
    fast = predict_latency_mode(launches_only, TINY, WL, requests=8, batch=4, dtype="bfloat16", slots=8)
    assert slow.step_seconds == pytest.approx(fast.step_seconds)


def test_a_micro_batchs_own_chain_bounds_a_layer_pass():
    """CPU attention and the GPU FFN overlap across micro-batches, never within one: a layer pass
    takes at least one micro-batch's GPU work, attention, FFN and activation round trip in turn."""
    for n in (1, 2, 4):
        pol = Policy(4 * n, 4, n, attn_on_gpu=False, ffn_on_gpu=True, r_w=0.5, r_c=0.0, dtype="bfloat16")
        lt = evaluate_policy(HW, TINY, WL, pol).layer_times
        trip = 4 * 64 * 2 / 1e10 + 4 * 128 * 2 / 5e9 + 2 * HW.link.latency_s  # attn output in, QKV out
        chain = (lt["T_cpu"] + lt["T_gpu"]) / n + trip
        assert lt["T_fill"] == pytest.approx(max(0.0, chain - max(lt["T_cpu"], lt["T_gpu"])))
        moved = max(lt["T_h2d"], lt["T_d2h"], lt["T_host"], lt["T_stage"])
        assert lt["T_layer"] == pytest.approx(max(moved, lt["T_cpu"], lt["T_gpu"], chain))
    same_level = evaluate_policy(HW, TINY, WL, Policy(8, 4, 2, True, True, 0.5, 0.0, "bfloat16")).layer_times
    assert same_level["T_fill"] == 0.0


@pytest.mark.parametrize("mu, n, r_w", [(1024, 1, 0.9), (512, 2, 0.9), (256, 4, 0.9), (4048, 1, 0.5)])
def test_the_plan_prices_one_micro_batch_as_the_cgopipe_task_graph_runs_it(mu, n, r_w):
    """With one micro-batch nothing overlaps the CPU's attention with the GPU's FFN: the plan's figure
    stays within 10% of the simulated task graph's at every micro-batch count (one was 1.3-1.8x above)."""
    from hrm import get_hardware, get_model
    from moelight.pipeline.schedule_simulator import simulate_policy

    hw, m, wl = get_hardware("s2"), get_model("olmoe-1b-7b"), WorkloadSpec(77, 128)
    res = evaluate_policy(hw, m, wl, Policy(mu * n, mu, n, False, True, r_w, 0.0, "bfloat16"))
    sim = simulate_policy(hw, m, wl, res.policy, "cgopipe")
    assert res.e2e_tok_s == pytest.approx(sim.e2e_tok_s, rel=0.10)


def test_buffers_hold_a_whole_moe_layer_in_a_model_with_dense_layers():
    """DeepSeek-V2-Lite's first layer is dense: the paged buffers, their pinned pages and a quantized
    run's expanded layer each hold one MoE layer's experts, not the average over all layers."""
    from dataclasses import replace

    from hrm import get_hardware

    m = get_model("deepseek-v2-lite")
    assert m.num_dense_layers > 0
    moe_layer = m.num_experts * m.expert_params()
    pol = Policy(64, 32, 2, False, True, 0.25, 0.0, "float16")
    res = evaluate_policy(get_hardware("t4"), m, WorkloadSpec(77, 128), pol)
    assert res.gpu_memory["paged_weight_buffers"] == pytest.approx(2 * 0.75 * moe_layer * 2)
    assert res.cpu_memory["pinned_weight_pages"] == pytest.approx(2 * 0.75 * moe_layer * 2 / 2)
    q = replace(m, expert_bits=4.5)
    res = evaluate_policy(get_hardware("t4"), q, WorkloadSpec(77, 128), pol)
    assert res.gpu_memory["dequantized_layer"] == pytest.approx(moe_layer * 2)


def test_latency_mode_counts_the_kv_pool_the_engine_allocates():
    """Latency mode's GPU holds a copy of the engine's KV pool (expert_cache/cache_executor._kv_of), so
    held_bytes counts wl.pool_tokens (each shared prefix once), not batch x max_context."""
    import dataclasses

    from optimizer.latency_mode import held_bytes

    per_token = costs.kv_cache_bytes(TINY, 1, 1, "bfloat16", layers=TINY.num_layers)
    pooled = dataclasses.replace(WL, kv_pool=(16, 24, 32, 40))  # 4 sequences share 8 of their 16 slots
    unshared = held_bytes(HW, TINY, WL, 4, "bfloat16")
    assert unshared - held_bytes(HW, TINY, pooled, 4, "bfloat16") == pytest.approx((4 * 16 - 40) * per_token)
