"""The one-pass rotary and RMSNorm kernels (csrc/norm_rotary.cpp) against the torch ops they replace:
rotary bit for bit in every dtype, RMSNorm of 16-bit activations within one rounding step (its mean
sums in another order), and the model's own modules taking them only where they apply."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from moelight.models.layers import RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(not dispatch.small_linear_available(), reason="C++ kernels unavailable")


def torch_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,d", [(1, 16, 64), (37, 4, 128), (5, 3, 6), (300, 16, 64)])
def test_rotary_rounds_as_torchs_three_ops_do(dtype, t, h, d):
    g = torch.Generator().manual_seed(t * h + d)
    proj = torch.randn(t, (h + 2) * d, generator=g).to(dtype)
    x = proj.view(t, h + 2, d)[:, 1:h + 1]  # heads strided inside a wider projection, as q / k views are
    cos, sin = torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype)
    got = dispatch.rotary(x, cos, sin)
    assert got is not None and torch.equal(got, torch_rotary(x, cos, sin))
    assert torch.equal(apply_rotary(x, cos, sin), got)


def test_rotary_leaves_what_it_does_not_take_to_torch():
    x, cos = torch.randn(2, 3, 8), torch.randn(2, 8)
    assert dispatch.rotary(x.requires_grad_(), cos, cos) is None  # training: autograd's ops
    assert dispatch.rotary(torch.randn(2, 3, 8), cos.bfloat16(), cos.bfloat16()) is None  # dtypes differ
    assert dispatch.rotary(torch.randn(2, 3, 8), torch.randn(1, 8), torch.randn(1, 8)) is None  # broadcast cos
    half = torch.randn(2, 3, 8).half()
    assert dispatch.rotary(half, cos.half(), cos.half()) is None  # float16: torch's ops
    assert torch.equal(apply_rotary(half, cos.half(), cos.half()), torch_rotary(half, cos.half(), cos.half()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1024), (64, 1024), (7, 4, 96)])
def test_rms_norm_of_16_bit_activations_is_torchs_within_one_rounding(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    got, ref = dispatch.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    differ = got != ref
    assert differ.float().mean() < 1e-3  # only where the two float32 means differ in their last bit
    step = torch.finfo(dtype).eps * ref.float().abs()
    assert ((got.float() - ref.float()).abs() <= step * 1.01)[differ].all()


def test_the_norm_module_keeps_torchs_steps_for_float32_and_takes_the_kernel_for_16_bit(monkeypatch):
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 96)
    assert dispatch.rms_norm(x, norm.weight, 1e-6) is None
    assert torch.equal(norm(x), torch_rms_norm(x, norm.weight, 1e-6))  # float32: exact against transformers
    calls = []
    real = dispatch.rms_norm
    monkeypatch.setattr(dispatch, "rms_norm", lambda *a: calls.append(1) or real(*a))
    half = norm.to(torch.bfloat16)
    with torch.inference_mode():
        out = half(x.bfloat16())
    assert calls and out.dtype == torch.bfloat16
