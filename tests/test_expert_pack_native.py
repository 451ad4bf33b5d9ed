"""The C++ packer (cpu_kernels.pack_experts -> csrc/expert_pack.cpp) writes exactly the bytes of the torch
reference (cpu_kernels.expert_pack.pack_experts) for every format, padded shapes, groups and biases."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch, expert_pack
from cpu_kernels.expert_pack import QuantMatrix, bf16_matrix
from cpu_kernels.expert_quant import quantize
from cpu_kernels.expert_strips import gate_up_rows, pack_experts_native

ARRAYS = ("w13", "s13", "z13", "w2", "s2", "z2", "bias13", "bias2")
FIELDS = ("fmt13", "group13", "fmt2", "group2", "hidden", "intermediate")

needs_kernels = pytest.mark.skipif(not dispatch._cpp_available(), reason="the C++ kernels do not load here")

# (experts, intermediate f, hidden h, group): whole strips; f and h padded to strips; groups over all of K
SHAPES = [(3, 64, 96, 32), (2, 48, 96, 32), (2, 40, 72, 0), (2, 80, 96, 16), (3, 24, 50, 0), (2, 64, 192, 64),
          (2, 96, 160, 32)]


def _matrices(fmt: str, e: int, f: int, h: int, group: int, additive: bool,
              g: torch.Generator) -> tuple[QuantMatrix, QuantMatrix]:
    w13, w2 = torch.randn(e, 2 * f, h, generator=g), torch.randn(e, h, f, generator=g)
    if fmt == "bf16":
        return bf16_matrix(w13), bf16_matrix(w2)
    group = group or h  # 0: one scale along all of K (int8 per channel)
    if fmt == "int8" or fmt == "int4":
        mats = quantize(w13, fmt, group), quantize(w2, fmt, group if group != h else f)
    else:
        def raw(w: torch.Tensor, grp: int) -> QuantMatrix:
            n, k = w.shape[1], w.shape[2]
            codes = (w.to(torch.float8_e4m3fn).view(torch.uint8) if fmt == "fp8"
                     else torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g))
            return QuantMatrix(fmt, codes, torch.rand(e, n, k // grp, generator=g), None, grp)
        mats = raw(w13, group), raw(w2, group if group != h else f)
    if additive:
        for m in mats:
            m.bias = torch.rand(m.scales.shape, generator=g)
    return mats


def _cases():
    for fmt in ("bf16", "int8", "fp8", "int4", "uint4", "mxfp4"):
        for shape in SHAPES:
            e, f, h, group = shape
            if fmt in ("int4", "uint4", "mxfp4") and (group == 0 or h % 2 or f % 2):
                continue
            if fmt == "int4" and group not in (32, 64, 128):
                continue
            if fmt != "bf16" and group and (h % group or f % group):
                continue
            for additive in ((False,) if fmt == "bf16" else (False, True)):
                yield fmt, shape, additive


def _same(a, b) -> None:
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None, name
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, name
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), name
    assert [getattr(a, n) for n in FIELDS] == [getattr(b, n) for n in FIELDS]


@needs_kernels
@pytest.mark.parametrize("fmt,shape,additive", list(_cases()))
def test_native_packing_matches_the_torch_reference(fmt, shape, additive):
    g = torch.Generator().manual_seed(hash((fmt, shape, additive)) % 2**31)
    e, f, h, group = shape
    gate_up, down = _matrices(fmt, e, f, h, group, additive, g)
    biases = (torch.randn(e, 2 * f, generator=g), torch.randn(e, h, generator=g)) if additive else (None, None)
    given = []

    def garbage(shape, dtype):  # every byte of the caller's buffers must be written
        given.append(torch.full(shape, 7, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1
                     else torch.full(shape, 7, dtype=dtype))
        return given[-1]

    ref = expert_pack.pack_experts(gate_up, down, *biases)
    _same(ref, dispatch.pack_experts(gate_up, down, *biases))
    into = pack_experts_native(gate_up, down, *biases, alloc=garbage)
    _same(ref, into)
    assert into.w13.data_ptr() == given[0].data_ptr()


@needs_kernels
def test_the_comparison_sees_swapped_nibbles():
    """A packer that put the two 4-bit codes of a byte the other way round would fail the test above."""
    g = torch.Generator().manual_seed(1)
    gate_up, down = _matrices("uint4", 2, 64, 96, 32, False, g)
    packed = pack_experts_native(gate_up, down)
    swapped = (packed.w13 >> 4) | (packed.w13 << 4)
    assert not torch.equal(swapped, expert_pack.pack_experts(gate_up, down).w13)


def test_gate_up_rows_interleave_16_gate_then_16_up_rows_and_pad():
    rows = gate_up_rows(20, 32).tolist()
    assert rows[:16] == list(range(16)) and rows[16:32] == list(range(20, 36))
    assert rows[32:36] == [16, 17, 18, 19] and rows[36:48] == [-1] * 12
    assert rows[48:52] == [36, 37, 38, 39] and rows[52:] == [-1] * 12


def test_without_the_kernels_pack_experts_is_the_reference(monkeypatch):
    monkeypatch.setattr(dispatch, "_cpp_available", lambda: False)
    gate_up, down = _matrices("int4", 2, 64, 96, 32, False, torch.Generator().manual_seed(2))
    _same(expert_pack.pack_experts(gate_up, down), dispatch.pack_experts(gate_up, down))
