"""The HRM for multi-head latent attention: the presets' sizes against the published models and the
engine's own count, the cache bytes per token, absorbed-decode and expanded-prefill FLOPs and bytes
worked out by hand for DeepSeek-V2-Lite, the latent's copies under tensor parallelism, and a plan
whose memory breakdown is checked by hand."""

from __future__ import annotations

import pytest

from hrm import WorkloadSpec, costs, get_hardware, get_model
from hrm import operators as ops


@pytest.mark.parametrize("name,total,active", [("deepseek-v2-lite", 15.7e9, 2.66e9), ("deepseek-v3", 671.0e9, 37.6e9),
                                               ("kimi-k2", 1026.4e9, 32.9e9), ("bench-deepseek", 0.776e9, 0.218e9)])
def test_preset_sizes(name, total, active):
    """Published: V2-Lite 15.7 B, V3 671 B (37 B active), Kimi-K2 1.04 T (32 B active); the engine counts
    the same model's parameters on the meta device (the HRM counts a router in dense layers too)."""
    from moelight.loading.presets import preset_config
    from moelight.planning.memory_check import parameter_count

    m = get_model(name)
    assert m.total_params() == pytest.approx(total, rel=2e-3)
    assert m.active_params() == pytest.approx(active, rel=1e-2)
    assert parameter_count(preset_config(name)) == pytest.approx(m.total_params(), rel=1e-4)  # HRM: a router per layer


def test_cache_bytes_per_token():
    """(512 + 64) x 2 B = 1,152 B per token and layer against Mixtral's 2 x 8 x 128 x 2 B = 4,096 B."""
    assert ops.kv_bytes_per_token_layer(get_model("deepseek-v3"), 2.0) == 1152
    assert ops.kv_bytes_per_token_layer(get_model("mixtral-8x7b"), 2.0) == 4096


def test_absorbed_decode_and_expanded_prefill_by_hand():
    """V2-Lite: H 16, r 512, e 64, n 128, v 128, h 2048, no q_lora."""
    m = get_model("deepseek-v2-lite")
    att = ops.decode_attention(m, 1, 1000, 2.0)  # every head: scores over 576, values over 512, per key
    assert att.flops == 2 * 16 * (576 + 512) * 1000
    assert att.bytes == 576 * 2 * 1000 + (16 * 576 + 576 + 16 * 512) * 2  # rows once; q in, latent out
    pre = ops.prefill_attention(m, 1, 100, 2.0)  # per head: q.k over 192, p.v over V padded to 192, 50 keys
    assert pre.flops == 2 * 16 * (192 + 192) * 100 * 50
    proj = ops.qkv_proj(m, 1, 2.0)  # q_proj, kv_a, the absorption W_UK, norms
    assert proj.flops == 2 * (2048 * 16 * 192 + 2048 * 576 + 16 * 128 * 512) + 4 * 2048
    expanded = ops.qkv_proj(m, 1, 2.0, prefill=True)  # kv_b over the latent instead of W_UK
    assert expanded.flops == 2 * (2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256) + 4 * 2048
    out = ops.o_proj(m, 1, 2.0)  # W_UV back from latent space, then o_proj
    assert out.flops == 2 * 16 * 512 * 128 + 2 * 16 * 128 * 2048 + 2048
    assert costs.qkv_bytes(m, 1, "bfloat16") == (16 * 576 + 576) * 2
    assert costs.attention_output_bytes(m, 1, "bfloat16") == 16 * 512 * 2


def test_the_latent_is_kept_once_per_rank():
    """Tensor-parallel ranks each keep (and read) the whole latent; GQA's KV heads are split, not copied."""
    import numpy as np

    from optimizer.cost_model import build_point_model

    v2, mixtral = get_model("deepseek-v2-lite"), get_model("mixtral-8x22b")
    assert costs.kv_copies(get_hardware("s7"), v2) == 4 and costs.kv_copies(get_hardware("t4"), v2) == 1
    assert costs.kv_copies(get_hardware("s7"), mixtral) == 1
    wl, one = WorkloadSpec(77, 128, 418), np.array([64.0])

    def host_kv(hw: str, m) -> float:
        return float(build_point_model(get_hardware(hw), m, wl, "float16", one, one, 0, 1).cpu_mem["kv_cache"].c0[0])

    assert host_kv("s7", v2) == pytest.approx(2 * host_kv("s6", v2))
    assert host_kv("s7", mixtral) == pytest.approx(host_kv("s6", mixtral))


def test_a_plan_checked_by_hand():
    """V2-Lite on a T4 host: the plan's KV cache is N sequences x (prompt + gen) tokens x 27 layers x
    1,152 B, and the host would hold several times that N; Mixtral 8x7B's is 131,072 B a token."""
    from optimizer import plan

    res = plan(get_hardware("t4"), get_model("deepseek-v2-lite"), WorkloadSpec(77, 128, 418), "float16")
    n = res.policy.batch_size
    kv = n * (77 + 128) * 27 * 1152
    assert res.cpu_memory["kv_cache"] == pytest.approx(kv, rel=1e-9)
    host = 0.9 * get_hardware("t4").cpu.memory_bytes - res.cpu_memory["experts"]
    assert host / ((77 + 128) * 27 * 1152) > 4 * n  # the latent cache is not what bounds N here


def test_absorbed_decode_is_priced_at_the_attention_kernels_rate():
    """~30 FLOP a byte: the latent decode binds on compute, at the measured attention rate (not GEMM's)."""
    from dataclasses import replace

    hw, m = get_hardware("cpu-server"), get_model("deepseek-v2-lite")
    slow = replace(hw, cpu=replace(hw.cpu, attention_flops={"bfloat16": hw.cpu.peak_flops("bfloat16") / 4}))
    flops = ops.decode_attention(m, 256, 100, 2.0).flops
    assert costs.attention_time(slow, m, 256, 100, "cpu", "bfloat16") >= flops / (hw.cpu.peak_flops("bfloat16") / 4)
    assert costs.attention_time(slow, m, 256, 100, "cpu", "bfloat16") > costs.attention_time(hw, m, 256, 100, "cpu",
                                                                                              "bfloat16")
