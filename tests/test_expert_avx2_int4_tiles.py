"""AVX2's int4 experts on int8 activations at many rows (csrc/expert_iq4_tiles_avx2.h): the codes are
unpacked a k-block at a time for all rows and multiplied in tiles of rows, but each row's integer
block sums and float32 steps are those of the few-row kernel. So a token alone (1 row per expert: the
few-row kernel) gets the same bits as among many, at every row tail of the tiles, past the rows one
pass keeps (96), at group sizes 32 / 64 / 128, over K with a partial last k-block (256 k)."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import pack_experts
from cpu_kernels.expert_quant import quantize_int4
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, _two_experts


@pytest.fixture
def avx2_int8_activations(monkeypatch):
    if not HAS_CPP or torch.ops.moelight.set_isa("avx2") != "avx2":
        torch.ops.moelight.set_isa("auto")
        pytest.skip("needs the AVX2 kernels")
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", True)
    yield
    torch.ops.moelight.set_isa("auto")


def _packed(h: int, f: int, group: int, biases: bool):
    g = torch.Generator().manual_seed(h + f + group)
    w13, w2 = torch.randn(4, 2 * f, h, generator=g) * 0.03, torch.randn(4, h, f, generator=g) * 0.03
    b13 = torch.randn(4, 2 * f, generator=g) * 0.05 if biases else None
    b2 = torch.randn(4, h, generator=g) * 0.05 if biases else None
    return pack_experts(quantize_int4(w13, group), quantize_int4(w2, group), b13, b2)


# (hidden, width, group): K = 288 ends on a 32-k k-block; 384: a 256-k k-block and a 128-k one
@pytest.mark.parametrize("h,f,group", [(288, 96, 32), (384, 320, 64), (384, 640, 128)])
@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
def test_many_rows_give_each_token_its_own_rows_bits(avx2_int8_activations, h, f, group, biases):
    packed = _packed(h, f, group, biases)
    act = ActSpec(1, 7.0, 1.702) if biases else ActSpec()
    t = 101  # rows per expert: two passes of 96 rows, tiles of 4 and tails of 1-3 below
    ids, weights = _two_experts(t)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(7)) * 2.0).to(torch.bfloat16)
    many = dispatch.expert_mix(x, ids, weights, packed, act)
    for lo, hi in [(0, 1), (1, 3), (3, 6), (6, 10), (10, 15), (15, 22), (22, 30), *((i, i + 1) for i in range(30, t))]:
        few = dispatch.expert_mix(x[lo:hi], ids[lo:hi], weights[lo:hi], packed, act)
        assert torch.equal(few, many[lo:hi]), f"h {h} f {f} group {group}, rows {lo}:{hi}"
