"""Operator FLOPs / bytes against numbers worked out by hand."""

import numpy as np
import pytest

from hrm import operators as ops
from hrm.model_presets import get_model

TINY = get_model("tiny")  # h=64 f=128 L=2 E=4 k=2 Hq=4 Hkv=2 d=16 V=512
MIX = get_model("mixtral-8x7b")


def test_experts_touched_expectation():
    # E(1-(1-k/E)^mu), E=8, k=2: mu=1 -> 2, mu=2 -> 8*(1-0.75^2)=3.5, mu large -> 8
    assert ops.experts_touched(MIX, 1) == pytest.approx(2.0)
    assert ops.experts_touched(MIX, 2) == pytest.approx(3.5)
    assert ops.experts_touched(MIX, 0) == pytest.approx(0.0)
    assert ops.experts_touched(MIX, 1000) == pytest.approx(8.0)
    np.testing.assert_allclose(ops.experts_touched(TINY, np.array([1, 3])), [2.0, 4 * (1 - 0.5**3)])


def test_qkv_projection_tiny():
    c = ops.qkv_proj(TINY, 10, 2.0)
    # out width = 4*16 + 2*2*16 = 128; FLOPs 2*10*64*128 + norm 4*10*64
    assert c.flops == pytest.approx(163840 + 2560)
    # weights (64*128 + 64)*2 bytes + activations 10*(64+128)*2
    assert c.bytes == pytest.approx(16512 + 3840)


def test_decode_attention_tiny():
    c = ops.decode_attention(TINY, 3, 100, 2.0)
    assert c.flops == pytest.approx(4 * 64 * 100 * 3)
    # KV: 2 * (2*16) * 100 * 2B * 3 seqs; q/new kv in + out: 3*(2*64 + 2*32)*2
    assert c.bytes == pytest.approx(38400 + 1152)
    # intensity independent of the number of sequences (the paper's Fig. 4 point)
    assert ops.decode_attention(MIX, 1, 500, 2.0).intensity == pytest.approx(
        ops.decode_attention(MIX, 64, 500, 2.0).intensity)


def test_expert_and_moe_ffn_mixtral():
    e = ops.expert_ffn(MIX, 5, 2.0)
    assert e.flops == pytest.approx(6 * 4096 * 14336 * 5)
    assert e.bytes == pytest.approx(3 * 4096 * 14336 * 2 + 2 * 5 * 4096 * 2)
    f = ops.moe_ffn(MIX, 1, 2.0)  # one token: top-2 experts read
    assert f.flops == pytest.approx(6 * 4096 * 14336 * 2)
    assert f.bytes == pytest.approx(2 * 3 * 4096 * 14336 * 2 + 2 * 4096 * 2)


def test_o_proj_router_lm_head_prefill():
    o = ops.o_proj(TINY, 2, 4.0)
    assert o.flops == pytest.approx(2 * 2 * 64 * 64 + 2 * 64)
    assert o.bytes == pytest.approx(64 * 64 * 4 + 2 * (64 + 128) * 4)
    r = ops.router(TINY, 2, 4.0)
    assert r.flops == pytest.approx(2 * 2 * 64 * 4 + 4 * 2 * 64)
    head = ops.lm_head(TINY, 3, 2.0)
    assert head.flops == pytest.approx(2 * 3 * 64 * 512 + 4 * 3 * 64)
    assert head.bytes == pytest.approx((512 * 64 + 64) * 2 + 3 * (64 + 512) * 2)
    pa = ops.prefill_attention(TINY, 2, 10, 2.0)
    assert pa.flops == pytest.approx(2 * 64 * 100 * 2)


def test_sizes_and_param_counts():
    assert ops.kv_bytes_per_token_layer(MIX, 2.0) == 2 * 8 * 128 * 2
    assert ops.layer_expert_bytes(MIX, 2.0) == 8 * 3 * 4096 * 14336 * 2
    # Mixtral 8x7B has 46.7B parameters (Mistral's announcement)
    assert MIX.total_params() == pytest.approx(46.70e9, rel=1e-3)
    # Mixtral 8x22B: 141B parameters
    assert get_model("mixtral-8x22b").total_params() == pytest.approx(141e9, rel=0.01)
    # DBRX: 132B parameters
    assert get_model("dbrx").total_params() == pytest.approx(132e9, rel=0.01)
