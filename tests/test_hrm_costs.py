"""hrm.costs (the simulator's contract): times = max(FLOPs/P, bytes/B) at the level, by hand."""

import numpy as np
import pytest

from hrm import costs
from hrm.hardware import HardwareSpec, Level, Link
from hrm.model_presets import get_model

TINY = get_model("tiny")
MIX = get_model("mixtral-8x7b")
CPU = Level("cpu", 1e11, 5e10, {"float32": 1e12, "bfloat16": 1e12})
GPU = Level("gpu", 1e10, 1e11, {"float32": 1e12, "bfloat16": 1e13})
HW = HardwareSpec("synthetic", CPU, GPU, 1, Link(h2d=1e10, d2h=5e9))


def test_pre_attention_memory_bound_on_gpu():
    # FLOPs 166400, bytes 20352 (see test_hrm_operators): max(1.664e-8, 2.0352e-7)
    assert costs.pre_attention_time(HW, TINY, 10, "gpu", "bfloat16") == pytest.approx(2.0352e-7)


def test_attention_on_cpu_and_gpu():
    # FLOPs 76800, bytes 39552
    assert costs.attention_time(HW, TINY, 3, 100, "cpu", "bfloat16") == pytest.approx(39552 / 5e10)
    assert costs.attention_time(HW, TINY, 3, 100, "gpu", "bfloat16") == pytest.approx(39552 / 1e11)


def test_post_attention_sums_kernels():
    mu, b = 4, 2.0
    o = (2 * mu * 64 * 64 + mu * 64, 64 * 64 * b + mu * (64 + 128) * b)
    r = (2 * mu * 64 * 4 + 4 * mu * 64, (64 * 4 + 64) * b + mu * (2 * 64 + 4) * b)
    touched = 4 * (1 - 0.5**mu)
    f = (6 * 64 * 128 * 2 * mu, touched * 3 * 64 * 128 * b + 2 * mu * 64 * b)
    want = sum(max(fl / 1e13, by / 1e11) for fl, by in (o, r, f))
    assert costs.post_attention_time(HW, TINY, mu, "gpu", "bfloat16") == pytest.approx(want)


def test_compute_bound_case_uses_flops():
    # float32 on this GPU: P=1e12. Mixtral FFN at mu=4096: FLOPs dominate.
    t = costs.post_attention_time(HW, MIX, 4096, "gpu", "float32")
    ffn_flops = 6 * 4096 * 14336 * 2 * 4096
    assert t >= ffn_flops / 1e12
    assert t == pytest.approx(ffn_flops / 1e12, rel=0.05)


def test_transfers_and_tensor_parallel_links():
    assert costs.h2d_time(HW, 1e9) == pytest.approx(0.1)
    assert costs.d2h_time(HW, 1e9) == pytest.approx(0.2)
    hw2 = HW.with_gpus(2)
    assert costs.h2d_time(hw2, 1e9) == pytest.approx(0.05)
    assert costs.pre_attention_time(hw2, TINY, 10, "gpu", "bfloat16") == pytest.approx(2.0352e-7 / 2)
    with pytest.raises(ValueError):
        costs.h2d_time(HW.with_gpus(0), 1.0)
    with pytest.raises(ValueError):
        costs.attention_time(HW.with_gpus(0), TINY, 1, 1, "gpu")


def test_sizes():
    assert costs.qkv_bytes(MIX, 10, "bfloat16") == 10 * (4096 + 2048) * 2
    assert costs.hidden_bytes(MIX, 10, "float32") == 10 * 4096 * 4
    assert costs.attention_output_bytes(MIX, 3, "bfloat16") == 3 * 4096 * 2
    assert costs.layer_expert_bytes(MIX, "bfloat16") == 8 * 3 * 4096 * 14336 * 2
    assert costs.kv_cache_bytes(MIX, 10, 100, "bfloat16", layers=32) == 10 * 100 * 4096 * 32
    np.testing.assert_allclose(costs.hidden_bytes(TINY, np.array([1, 2]), "bfloat16"), [128, 256])


def test_prefill_and_lm_head():
    t = costs.lm_head_time(HW, TINY, 1, "gpu", "bfloat16")
    assert t == pytest.approx(((512 * 64 + 64) * 2 + (64 + 512) * 2) / 1e11)
    assert costs.prefill_layer_time(HW, TINY, 2, 8, "gpu", "bfloat16") > costs.pre_attention_time(
        HW, TINY, 16, "gpu", "bfloat16")
