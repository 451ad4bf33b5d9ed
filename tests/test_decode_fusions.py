"""A decode step's fused small ops against the unfused path they replace, bit for bit: the residual add with its
RMSNorm (add_rms_norm), the K/V cache write (kv_write), small_linear's in-op rounding (and its set_isa("none")
path), and the expert kernel's AVX-512 int8 row quantize against its scalar loop and a torch reference."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from cpu_kernels import dispatch
from moelight.loading.presets import PRESETS
from moelight.models import moe
from moelight.models.gpt_oss import RMSNormF32Scale
from moelight.models.layers import RMSNorm, add_and_norm
from moelight.models.mixtral import DecoderLayer

pytestmark = pytest.mark.skipif(not dispatch.small_linear_available(), reason="C++ kernels unavailable")


def _cpu_has(flag: str) -> bool:
    return os.path.exists("/proc/cpuinfo") and f" {flag}" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1024), (3, 96), (2, 5, 64)])
def test_add_rms_norm_is_torchs_add_then_the_norm(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    delta = (torch.randn(shape, generator=g) * 0.01).to(dtype)  # small: the sum rounds (double rounding too)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got_sum, got_norm = dispatch.add_rms_norm(x, delta, w, 1e-5)
    want_sum = x + delta
    assert torch.equal(got_sum, want_sum)
    assert torch.equal(got_norm, dispatch.rms_norm(want_sum, w, 1e-5))


def test_rmsnorm_residual_fuses_only_its_own_norm():
    g = torch.Generator().manual_seed(1)
    x, delta = torch.randn(1, 64, generator=g).to(torch.bfloat16), torch.randn(1, 64, generator=g).to(torch.bfloat16)
    for norm in (RMSNorm(64, 1e-6), RMSNormF32Scale(64, 1e-6)):  # GPT-OSS's scales in float32: its own forward
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=g))
        norm = norm.to(torch.bfloat16)
        s, h = add_and_norm(norm, x, delta)
        assert torch.equal(s, x + delta) and torch.equal(h, norm(x + delta))
    s, h = add_and_norm(torch.nn.Identity(), x, delta)  # a norm without `residual`
    assert torch.equal(s, x + delta) and torch.equal(h, x + delta)


def test_decoder_layer_post_attention_is_unchanged_by_the_fusion(monkeypatch):
    cfg = replace(PRESETS["bench-1b"], hidden_size=128, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                  num_experts=4, top_k=2)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = layer.to(torch.bfloat16).eval()
    x = torch.randn(2, 128).to(torch.bfloat16)
    attn = torch.randn(2, 128).to(torch.bfloat16)
    with torch.inference_mode():
        fused = layer.post_attention(x, attn)
        monkeypatch.setattr(dispatch, "add_rms_norm", lambda *a: None)
        plain = layer.post_attention(x, attn)
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 200])
def test_kv_write_is_index_copy(dtype, t):
    g = torch.Generator().manual_seed(t)
    h, s, d = 2, 512, 32
    k_cache, v_cache = torch.randn(h, s, d, generator=g).to(dtype), torch.randn(h, s, d, generator=g).to(dtype)
    proj = torch.randn(t, 6 * d, generator=g).to(dtype)  # k / v strided views of one projection, as decode's
    k, v = proj[:, 2 * d:4 * d].view(t, h, d), proj[:, 4 * d:].view(t, h, d)
    slots = torch.randperm(s, generator=g)[:t]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.index_copy_(1, slots, k.transpose(0, 1))
    want_v.index_copy_(1, slots, v.transpose(0, 1))
    with torch.inference_mode():
        assert dispatch.kv_write(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.moelight.kv_write(k_cache, v_cache, k, v, torch.full((t,), s, dtype=torch.int64))


@pytest.mark.parametrize("rows,k,n,bias", [(1, 1024, 3000, False), (4, 200, 77, True), (2, 40, 5, True)])
def test_small_linear_rounds_its_float32_sums(cpp_backend, rows, k, n, bias):
    """A 16-bit input gives its float32 input's sums (+ bias) rounded once to its dtype."""
    g = torch.Generator().manual_seed(rows + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(rows, k, generator=g).to(dtype)
        sums = dispatch.small_linear(x.float(), w, b)
        assert sums.dtype == torch.float32
        assert torch.equal(dispatch.small_linear(x, w, b), sums.to(dtype))
    x = torch.randn(rows, 2 * k, generator=g).to(torch.bfloat16)[:, ::2]  # not contiguous
    assert torch.equal(dispatch.small_linear(x, w, b), dispatch.small_linear(x.contiguous(), w, b))


def test_small_linear_under_isa_none_computes_through_torch():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 64, generator=g).to(torch.bfloat16), torch.randn(48, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(48, generator=g)
    try:
        assert torch.ops.moelight.set_isa("none") == "none"
        assert dispatch.small_linear_available()
        got = dispatch.small_linear(x, w, b)
    finally:
        torch.ops.moelight.set_isa("auto")
    want = torch.nn.functional.linear(x.float(), w.float(), b).to(torch.bfloat16)
    assert torch.equal(got, want)


def _torch_row_quant(x: torch.Tensor):
    """RowQuant's definition: per block of 32, scale amax / 127, codes round-half-even(v * (127 / amax))."""
    v = x.float().view(x.shape[0], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    # a true division: Python's 127.0 / t is 127 * (1 / t) in torch
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(v * inv).clamp(-127, 127).to(torch.int32)
    return q.to(torch.int8).view_as(x), (amax / 127.0).squeeze(-1), q.sum(-1, dtype=torch.int32)


@pytest.mark.parametrize("loop,flag", [("avx2", "avx2"), ("avx512", "avx512bw")])
@pytest.mark.parametrize("k", [32, 1024, 3584])
def test_row_quant_vector_loops_are_the_scalar_loop(k, loop, flag):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(64, k, generator=g) * torch.rand(64, 1, generator=g) * 8
    x[0] = 0.0  # an all-zero row: scale 0, codes 0
    x[1, :32] = torch.arange(32) - 15.5  # halves in v * inv: ties, to even
    x[2, :32] = -0.0  # a block of negative zeros: scale 0, codes 0
    x = x.to(torch.bfloat16)
    scalar = torch.ops.moelight.row_quant_int8(x, "scalar")
    for got, want in zip(scalar, _torch_row_quant(x), strict=True):
        assert torch.equal(got, want)
    if not _cpu_has(flag):
        pytest.skip(f"CPU lacks {flag}")
    for got, want in zip(torch.ops.moelight.row_quant_int8(x, loop), scalar, strict=True):
        assert torch.equal(got, want)


def test_row_quant_names_an_unknown_loop():
    with pytest.raises(RuntimeError, match="scalar, avx2 or avx512"):
        torch.ops.moelight.row_quant_int8(torch.zeros(1, 32, dtype=torch.bfloat16), "sse")


@pytest.mark.parametrize("rows,experts,top_k", [(1, 8, 2), (3, 64, 8), (4, 60, 4)])
@pytest.mark.parametrize("normalize", [True, False])
def test_route_in_one_call_is_the_python_steps(monkeypatch, rows, experts, top_k, normalize):
    g = torch.Generator().manual_seed(rows * experts + top_k)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    gate = (torch.randn(experts, 256, generator=g) * 0.1).to(torch.bfloat16)
    with torch.inference_mode():
        fused = moe.route(x, gate, top_k, normalize)
        monkeypatch.setattr(moe, "few_bf16_rows", lambda *a: False)  # router_logits' small_linear, unfused steps
        monkeypatch.setattr(moe, "router_logits", lambda x, w: dispatch.small_linear(x, w))
        plain = moe.route(x, gate, top_k, normalize)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
