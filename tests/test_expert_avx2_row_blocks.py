"""AVX2's expert GEMMs at many rows per expert (csrc/expert_isa_avx2.cpp): 3 rows and more multiply
k-blocks of the strip widened (or dequantised) once to float32, 3 rows at a time; int4 on int8
activations 4 rows at a time; 1-2 rows widen in registers. Every row keeps its own sums in the same
order whichever path its expert's row count picks, so a token's output is bitwise the same alone and
among 2 to 5 rows of its experts, in every format, with and without int8 activations."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, SHAPES, _case, _two_experts


@pytest.fixture
def avx2():
    if not HAS_CPP or torch.ops.moelight.set_isa("avx2") != "avx2":
        torch.ops.moelight.set_isa("auto")
        pytest.skip("needs the AVX2 kernels")
    yield
    torch.ops.moelight.set_isa("auto")


# odd-widths: K = 224 (gate/up) and 80 (down), a k-block of 64 pair rows and a partial one;
# qwen3-bench: K = 1024 (8 blocks) and 224
@pytest.mark.parametrize("shape", [SHAPES[8], SHAPES[3]], ids=[SHAPES[8][0], SHAPES[3][0]])
@pytest.mark.parametrize("int8_activations", [False, True], ids=["bf16-activations", "int8-activations"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mxfp4"])
def test_a_tokens_output_does_not_depend_on_its_experts_row_count(avx2, shape, fmt, int8_activations, monkeypatch):
    if fmt == "int4" and shape is SHAPES[8]:
        pytest.skip("no int4 group divides odd-widths' K = 200")
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", int8_activations)
    *_, h, _, clamped = shape
    *_, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    t = 15
    ids, weights = _two_experts(t)  # t rows on each of two experts
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(21)).to(torch.bfloat16)
    many = dispatch.expert_mix(x, ids, weights, packed, act)
    for lo, hi in ((0, 1), (1, 3), (3, 6), (6, 10), (10, 15)):  # 1 to 5 rows per expert
        few = dispatch.expert_mix(x[lo:hi], ids[lo:hi], weights[lo:hi], packed, act)
        assert torch.equal(few, many[lo:hi]), f"{shape[0]} {fmt}, rows {lo}:{hi}"
