"""AMX's quantized strips at many rows per expert: dequantised into the tile GEMM's scratch a k-block
at a time between its tile products (expert_isa_amx.cpp, tile_qgemm), not in a pass before them.
The tiles must see exactly the bf16 weights the dequantisation writes, in the same summation order:
each token's output is bitwise that of a bf16 pack holding those dequantised weights."""

from __future__ import annotations

import pytest
import torch

import cpu_kernels
from cpu_kernels import dispatch
from cpu_kernels.expert_pack import QuantMatrix, bf16_matrix, dequantize, pack_experts
from cpu_kernels.expert_quant import quantize_int4, quantize_int8
from cpu_kernels.expert_reference import ActSpec


@pytest.fixture
def amx(monkeypatch):
    if cpu_kernels.kernel_backend() == "torch" or torch.ops.moelight.set_isa("amx") != "amx":
        torch.ops.moelight.set_isa("auto")
        pytest.skip("needs the AMX kernels")
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", False)  # the bf16 path's numbers at every row count
    yield
    torch.ops.moelight.set_isa("auto")


def _exact(m: QuantMatrix) -> QuantMatrix:
    """m with power-of-two scales (and int4's bias -8 s): code x scale + bias is then exact in float32,
    so torch's dequantize and the kernel's fused multiply-add give the same value before bf16 rounding."""
    s = torch.exp2(torch.round(torch.log2(m.scales)))
    return QuantMatrix(m.fmt, m.codes, s, None if m.bias is None else -8.0 * s, m.group)


# (name, experts, top-k, hidden, width, tokens): 64 rows per expert (bench-1b's T = 256), and 40
# (two groups of 16, then a last group of 16 on its own)
CASES = [("wide", 4, 2, 256, 512, 128), ("tail", 3, 1, 160, 288, 120)]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_quantized_tiles_equal_the_bf16_tiles_of_the_dequantised_weights(amx, fmt, case):
    _, e, k, h, f, t = case
    g = torch.Generator().manual_seed(3)
    w13, w2 = torch.randn(e, 2 * f, h, generator=g) * 0.03, torch.randn(e, h, f, generator=g) * 0.03
    quant = (lambda w: _exact(quantize_int8(w))) if fmt == "int8" else (lambda w: _exact(quantize_int4(w, 32)))
    m13, m2 = quant(w13), quant(w2)
    b13, b2 = torch.randn(e, 2 * f, generator=g) * 0.05, torch.randn(e, h, generator=g) * 0.05
    packed = pack_experts(m13, m2, b13, b2)
    as_bf16 = pack_experts(bf16_matrix(dequantize(m13)), bf16_matrix(dequantize(m2)), b13, b2)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    act = ActSpec(1, 7.0, 1.702)
    got = dispatch.expert_mix(x, ids, weights, packed, act)
    want = dispatch.expert_mix(x, ids, weights, as_bf16, act)
    assert torch.count_nonzero(ids.flatten().bincount(minlength=e) <= 10) == 0  # every expert on the tiles, not VNNI
    assert torch.equal(got, want)
