"""strip_linear (csrc/strip_linear.cpp): a bf16 weight in the expert kernel's strips times bf16 rows, on every
kernel path, against a float64 reference of the same bf16 values; the packers; its refusals; PackedLinear's
'strips' form (what the CPU engine holds where oneDNN packs no bf16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import QuantMatrix, _strips
from cpu_kernels.strip_linear import pack_linear_strips, strip_linear, strips_fit, unpack_linear_strips
from moelight.runtime import cpu_linear

# (N, K, rows): N past whole strips, K of one strip, a k-block's depth and beyond, rows 0-2 (the in-register
# path), 3 and more (the widened k-blocks), past one row block (64) and across two
CASES = [(100, 64, 1), (64, 96, 2), (37, 32, 3), (512, 256, 7), (1000, 1024, 65), (96, 160, 130), (64, 64, 0)]


@pytest.mark.parametrize("n,k,m", CASES)
@pytest.mark.parametrize("biased", [False, True])
def test_strip_linear_is_the_float32_sums_rounded_once(backend, n, k, m, biased):
    g = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(2, m, k, generator=g).to(torch.bfloat16)  # leading dims kept
    b = torch.randn(n, generator=g) if biased else None
    y = strip_linear(x, pack_linear_strips(w), b, n)
    assert y.shape == (2, m, n) and y.dtype == torch.bfloat16
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums of exact products, in some order, rounded once to bf16: within bf16's half step of the
    # exact sum plus float32's accumulated rounding
    bound = exact.abs() * 2.0 ** -8 + x.double().abs() @ w.double().abs().T * k * 2.0 ** -24 + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


def test_the_cpp_packer_writes_the_reference_strips():
    if not dispatch.packs_expert_by_expert():
        pytest.skip("no C++ kernels here")
    w = torch.randn(70, 96).to(torch.bfloat16)
    ref = _strips(QuantMatrix("bf16", w[None]), 96)[0].view(3, 96 * 32)
    packed = pack_linear_strips(w)
    assert torch.equal(packed, ref)
    assert torch.equal(unpack_linear_strips(packed, 70), w)


def test_strip_linear_refuses_what_the_strips_cannot_take():
    if not dispatch.small_linear_available():
        pytest.skip("no C++ kernels here")
    strips = pack_linear_strips(torch.randn(64, 96).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="input has 64 features; the strips hold 96"):
        torch.ops.moelight.strip_linear(torch.randn(2, 64).to(torch.bfloat16), strips, None, 64)
    with pytest.raises(RuntimeError, match="2 strips cannot hold 65 outputs"):
        torch.ops.moelight.strip_linear(torch.randn(2, 96).to(torch.bfloat16), strips, None, 65)
    with pytest.raises(RuntimeError, match="bias has 3 values, not 64"):
        torch.ops.moelight.strip_linear(torch.randn(2, 96).to(torch.bfloat16), strips, torch.zeros(3), 64)
    with pytest.raises(RuntimeError, match="takes bf16 rows"):
        torch.ops.moelight.strip_linear(torch.randn(2, 96), strips, None, 64)
    assert strips_fit(96)
    assert not strips_fit(100)


@pytest.mark.parametrize("plain", [False, True])
def test_a_strips_layer_is_the_linear_and_reads_its_plain_weight_for_few_rows(plain, monkeypatch):
    """PackedLinear in the 'strips' form: the bf16 layer's outputs up to bf16 rounding at every row count; with
    its plain copy, up to SMALL_LINEAR_ROWS rows go to small_linear, more to the strips."""
    if not dispatch.small_linear_available():
        pytest.skip("no C++ kernels here")
    lin = nn.Linear(256, 200).to(torch.bfloat16)
    layer = cpu_linear.PackedLinear(lin, form="strips", plain=plain)
    assert layer.packed.shape == (7, 256 * 32) and (layer.weight_bf16 is not None) == plain
    calls = []
    real = dispatch.small_linear
    monkeypatch.setattr(dispatch, "small_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        ref = lin(x)
        assert (layer(x).float() - ref.float()).abs().max() <= 2 ** -6 * ref.abs().max()
    assert calls == ([(1, 256), (4, 256)] if plain else [])


def test_strips_where_oneDNN_packs_no_bf16_and_the_kernels_run_them(monkeypatch):
    """linear_form: strips need whole strips of input width and the AVX2 / AVX-512 GEMM; else a float32 copy."""
    real = cpu_linear.packing_supported
    if not real(torch.float32):
        pytest.skip("no oneDNN packing on this torch build")
    monkeypatch.setattr(cpu_linear, "packing_supported", lambda dt: dt != torch.bfloat16 and real(dt))
    monkeypatch.setattr(cpu_linear, "strip_linear_available", lambda: True)
    assert cpu_linear.linear_form(torch.bfloat16, 2048) == "strips"
    assert cpu_linear.linear_form(torch.bfloat16, 2040) == "float32"
    assert cpu_linear.linear_form(torch.float32, 2048) == "packed"
    assert cpu_linear.extra_linear_bytes(torch.bfloat16, 2048, plain=False) == 0
    assert cpu_linear.extra_linear_bytes(torch.bfloat16, 2040, plain=False) == 2
    monkeypatch.setattr(cpu_linear, "strip_linear_available", lambda: False)
    assert cpu_linear.linear_form(torch.bfloat16, 2048) == "float32"
