"""AVX2's int4 and MXFP4 experts on int8 activations at many rows (csrc/expert_iq4_tiles_avx2.h): the
codes are unpacked a k-block at a time for all rows and multiplied in tiles of rows, but each row's
integer block sums and float32 steps are those of the few-row kernel. So a token alone (1 row per
expert: the few-row kernel) gets the same bits as among many, at every row tail of the tiles, past
the rows one pass keeps (96), at group sizes 32 / 64 / 128, over K with a partial last k-block (256 k).
MXFP4's offset codes keep exact int16 sums at its largest codes times the largest activations."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import QuantMatrix, pack_experts
from cpu_kernels.expert_quant import quantize_int4
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, REL_TOL, _mxfp4, _reference, _two_experts


@pytest.fixture
def avx2_int8_activations(monkeypatch):
    if not HAS_CPP or torch.ops.moelight.set_isa("avx2") != "avx2":
        torch.ops.moelight.set_isa("auto")
        pytest.skip("needs the AVX2 kernels")
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", True)
    yield
    torch.ops.moelight.set_isa("auto")


def _packed(h: int, f: int, group: int, biases: bool, fmt: str = "int4"):
    g = torch.Generator().manual_seed(h + f + group)
    w13, w2 = torch.randn(4, 2 * f, h, generator=g) * 0.03, torch.randn(4, h, f, generator=g) * 0.03
    b13 = torch.randn(4, 2 * f, generator=g) * 0.05 if biases else None
    b2 = torch.randn(4, h, generator=g) * 0.05 if biases else None
    if fmt == "mxfp4":  # e2m1 codes with a power-of-two scale per 32 k
        return pack_experts(_mxfp4(w13), _mxfp4(w2), b13, b2)
    return pack_experts(quantize_int4(w13, group), quantize_int4(w2, group), b13, b2)


# (hidden, width, group, format): K = 288 ends on a 32-k k-block; 384: a 256-k k-block and a 128-k one
CASES = [(288, 96, 32, "int4"), (384, 320, 64, "int4"), (384, 640, 128, "int4"), (288, 96, 32, "mxfp4"),
         (384, 640, 32, "mxfp4")]


@pytest.mark.parametrize("h,f,group,fmt", CASES)
@pytest.mark.parametrize("biases", [False, True], ids=["plain", "biases"])
def test_many_rows_give_each_token_its_own_rows_bits(avx2_int8_activations, h, f, group, fmt, biases):
    packed = _packed(h, f, group, biases, fmt)
    act = ActSpec(1, 7.0, 1.702) if biases else ActSpec()
    t = 101  # rows per expert: two passes of 96 rows, tiles of 4 and tails of 1-3 below
    ids, weights = _two_experts(t)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(7)) * 2.0).to(torch.bfloat16)
    many = dispatch.expert_mix(x, ids, weights, packed, act)
    for lo, hi in [(0, 1), (1, 3), (3, 6), (6, 10), (10, 15), (15, 22), (22, 30), *((i, i + 1) for i in range(30, t))]:
        few = dispatch.expert_mix(x[lo:hi], ids[lo:hi], weights[lo:hi], packed, act)
        assert torch.equal(few, many[lo:hi]), f"{fmt} h {h} f {f} group {group}, rows {lo}:{hi}"


@pytest.mark.parametrize("t", [1, 2, 3, 40], ids=lambda t: f"{t}-rows")
def test_mxfp4_largest_codes_times_largest_activations_stay_exact(avx2_int8_activations, t):
    """Every weight +6 (e2m1's largest: offset code 24) and every activation alike (int8 code 127): a
    multiply-add of a pair is 2 x 24 x 127 = 6,096, so an int16 lane holds 5 of them; more than that
    before widening would wrap and land far from the reference. The few-row kernel (1-3 rows) and the
    tiles (40) alike."""
    h, f = 512, 256
    codes13, codes2 = torch.full((2, 2 * f, h // 2), 0x77, dtype=torch.uint8), torch.full((2, h, f // 2), 0x77,
                                                                                            dtype=torch.uint8)
    m13 = QuantMatrix("mxfp4", codes13, torch.full((2, 2 * f, h // 32), 2.0 ** -8), None, 32)
    m2 = QuantMatrix("mxfp4", codes2, torch.full((2, h, f // 32), 2.0 ** -8), None, 32)
    packed = pack_experts(m13, m2)
    ids = torch.zeros(t, 1, dtype=torch.int64)
    weights = torch.ones(t, 1)
    x = torch.full((t, h), 0.5).to(torch.bfloat16)
    got = dispatch.expert_mix(x, ids, weights, packed, ActSpec()).double()
    ref = _reference(x, ids, weights, m13, m2, None, None, ActSpec())
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < REL_TOL, f"{t} rows: relative error {err:.4f}"
