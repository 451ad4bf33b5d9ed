"""The expert kernel's by-expert schedule (csrc/expert_by_expert.h): at a few rows per expert each thread
runs whole experts, gate/up then down, and a token's pairs are summed at the end in the strip schedule's
order. Its outputs must equal the strip schedule's bit for bit: uneven experts, top-k 2 to 8, 1 to 10
tokens, int8 and int4 (with the clamped SwiGLU's biases), every ISA with int8-activation products, 1 and
2 threads; and the rule must leave calls it cannot take (bf16, rows above the VNNI crossover) alone."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, SHAPES, _case, _has_vnni, _routing

# (shape, format): mixtral-bench top-2, qwen3-30b top-8 (9 experts), qwen3-bench top-8 of 128, the
# clamped SwiGLU with biases (6 experts top-2) and widths that are not multiples of 32
CASES = [(SHAPES[0], "int4"), (SHAPES[0], "int8"), (SHAPES[2], "int4"), (SHAPES[3], "int8"), (SHAPES[7], "int4"),
         (SHAPES[7], "int8"), (SHAPES[8], "int8")]
IDS = ["mixtral-int4", "mixtral-int8", "qwen3-30b-int4", "qwen3-bench-int8", "clamped-int4", "clamped-int8",
       "odd-widths-int8"]


@pytest.fixture(params=["amx", "avx512bf16", "avx512", "avx2"])
def int_isa(request):
    name = request.param
    if not HAS_CPP or torch.ops.moelight.set_isa(name) != name or (name != "avx2" and not _has_vnni()):
        torch.ops.moelight.set_isa("auto")
        pytest.skip(f"needs the {name} kernels with int8-activation products")
    yield name
    torch.ops.moelight.set_isa("auto")
    torch.ops.moelight.set_expert_schedule("auto")


def _mix(schedule: str, x, ids, weights, packed, act) -> torch.Tensor:
    assert torch.ops.moelight.set_expert_schedule(schedule) == schedule
    try:
        return dispatch.expert_mix(x, ids, weights, packed, act)
    finally:
        torch.ops.moelight.set_expert_schedule("auto")


@pytest.mark.parametrize("shape,fmt", CASES, ids=IDS)
def test_by_expert_equals_the_strip_schedule(int_isa, shape, fmt):
    name, e, k, h, f, clamped = shape
    *_, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    threads = torch.get_num_threads()
    try:
        for t in range(1, 11):
            for skew in (False, True):  # skew: most tokens on two experts, the rest on few
                ids, weights = _routing(t, e, k, seed=100 + t, skew=skew)
                x = (torch.randn(t, h, generator=torch.Generator().manual_seed(t)) * (3.0 if clamped else 1.0))
                x = x.to(torch.bfloat16)
                strips = _mix("strips", x, ids, weights, packed, act)
                for n in sorted({1, threads}):
                    torch.set_num_threads(n)
                    got = _mix("experts", x, ids, weights, packed, act)
                    torch.set_num_threads(threads)
                    assert torch.equal(got, strips), f"{name} {fmt} on {int_isa}: {t} tokens, skew {skew}, {n} threads"
                assert torch.equal(_mix("auto", x, ids, weights, packed, act), strips)
    finally:
        torch.set_num_threads(threads)


def test_rule_leaves_other_calls_to_the_strip_schedule(int_isa):
    """bf16 experts, and rows above the VNNI crossover on AMX, cannot run by expert: forcing it changes nothing."""
    for shape, fmt, t in ((SHAPES[0], "bf16", 2), (SHAPES[7], "int4", 40)):
        name, e, k, h, f, clamped = shape
        *_, packed = _case(shape, fmt)
        ids = torch.tensor([[1, 3]] * t)
        weights = torch.rand(t, 2, generator=torch.Generator().manual_seed(3))
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
        assert torch.equal(_mix("experts", x, ids, weights, packed, act), _mix("strips", x, ids, weights, packed, act))


@pytest.mark.skipif(not HAS_CPP, reason="needs the C++ kernels")
def test_an_unknown_schedule_is_named_and_changes_nothing():
    torch.ops.moelight.set_expert_schedule("strips")
    try:
        with pytest.raises(RuntimeError, match="'auto', 'strips' or 'experts', got 'expert'"):
            torch.ops.moelight.set_expert_schedule("expert")
        assert torch.ops.moelight.set_expert_schedule("strips") == "strips"  # still what it was
    finally:
        torch.ops.moelight.set_expert_schedule("auto")
