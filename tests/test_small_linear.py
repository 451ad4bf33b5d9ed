"""The few-row bf16 linear kernel (decode matmuls on a CPU whose oneDNN packs no bf16): against a
float64 matmul of the same bf16 values, and inside PackedLinear beside the float32-copy path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_kernels import dispatch
from moelight.runtime import cpu_linear

pytestmark = pytest.mark.skipif(not dispatch.small_linear_available(), reason="C++ kernels unavailable")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n,bias", [(1024, 3000, False), (200, 77, True), (40, 5, True)])
def test_small_linear_matches_float64(cpp_backend, rows, k, n, bias):
    """On every ISA level: AVX2's loop, and the AVX-512 one the AVX-512 levels (and AMX) run."""
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    got = dispatch.small_linear(x, w, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums rounded once to bf16: within bf16's half-ulp of the exact value
    assert torch.allclose(got.double(), ref, rtol=2 ** -8, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("k,n", [(4096, 131), (1024, 3000), (200, 77), (40, 5), (64, 1)])
def test_one_row_sums_as_that_row_of_a_two_row_call(cpp_backend, k, n):
    """At one row the AVX-512 loop runs output rows in pairs (two weight streams, the row left over alone);
    each output row still sums its products in the multi-row loop's order: the same float32 sums."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(2, k, generator=g)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    assert torch.equal(dispatch.small_linear(x[:1], w), dispatch.small_linear(x, w)[:1])


def test_small_linear_keeps_leading_dims_and_refuses_many_rows():
    w = torch.randn(64, 96).to(torch.bfloat16)
    x = torch.randn(1, 3, 96).to(torch.bfloat16)
    assert dispatch.small_linear(x, w).shape == (1, 3, 64)
    with pytest.raises(RuntimeError, match="at most 4 rows, got 5"):
        torch.ops.moelight.small_linear(torch.randn(5, 96).to(torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="input has 95 features, the weight 96"):
        torch.ops.moelight.small_linear(torch.randn(1, 95).to(torch.bfloat16), w, None)


def test_packed_linear_reads_the_bf16_weight_for_few_rows(monkeypatch):
    if not cpu_linear.packing_supported(torch.float32):
        pytest.skip("no oneDNN packing on this torch build")
    lin = nn.Linear(256, 384).to(torch.bfloat16)
    layer = cpu_linear.PackedLinear(lin, form="float32")
    calls = []
    real = dispatch.small_linear
    monkeypatch.setattr(dispatch, "small_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(9, 256).to(torch.bfloat16)
    many = layer(x)  # 9 rows: the packed float32 copy
    few = torch.cat([layer(x[i:i + 3]) for i in range(0, 9, 3)])
    assert calls == [(3, 256)] * 3
    ref = lin(x.float().to(torch.bfloat16))
    scale = ref.abs().max()
    assert (few.float() - many.float()).abs().max() <= 2 ** -7 * scale
    assert (few.float() - ref.float()).abs().max() <= 2 ** -6 * scale
