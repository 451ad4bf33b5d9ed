"""cpu_kernels.dispatch.expert_mix's per-call glue: inputs that are already what the op takes (contiguous
bf16 x, int64 ids, float32 weights: the engine's one-row decode calls) go to the op as they are, with no
conversion call (each cost a cold call ~10-20 us, benchmarks/results/expert_int4_t1_amx.md); other dtypes
and layouts are still converted, with the same outputs."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from cpu_kernels import dispatch
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, SHAPES, _case, _routing

pytestmark = pytest.mark.skipif(not HAS_CPP, reason="needs the C++ kernels")

CONVERSIONS = {"to", "contiguous", "float", "bfloat16", "long", "clone", "type"}


class CountedConversions(TorchFunctionMode):
    """Counts Tensor conversion methods called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in CONVERSIONS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _inputs(t: int):
    name, e, k, h, f, clamped = SHAPES[0]
    *_, packed = _case(SHAPES[0], "int4")
    ids, weights = _routing(t, e, k, seed=7)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    return x, ids.contiguous(), weights.contiguous(), packed


@pytest.mark.parametrize("t", [1, 8])
def test_ready_inputs_reach_the_op_without_conversion_calls(t):
    x, ids, weights, packed = _inputs(t)
    with CountedConversions() as mode:
        out = dispatch.expert_mix(x, ids, weights, packed, ActSpec())
    assert mode.calls == []
    assert out.dtype == torch.bfloat16 and out.shape == x.shape


def test_other_dtypes_and_layouts_are_converted_with_the_same_outputs():
    x, ids, weights, packed = _inputs(5)
    want = dispatch.expert_mix(x, ids, weights, packed, ActSpec())
    # float32 x (the output comes back in x's dtype), int32 ids, weights a non-contiguous view
    wide = torch.stack([weights, weights], dim=2)[..., 0]
    assert not wide.is_contiguous() and torch.equal(wide, weights)
    got = dispatch.expert_mix(x.float(), ids.to(torch.int32), wide, packed, ActSpec())
    assert got.dtype == torch.float32
    assert torch.equal(got, want.float())
    # x a non-contiguous bf16 view
    xt = torch.stack([x, x], dim=2)[..., 0]
    assert not xt.is_contiguous()
    assert torch.equal(dispatch.expert_mix(xt, ids, weights, packed, ActSpec()), want)
