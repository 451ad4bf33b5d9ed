"""AMX hosts multiply an int8 / int4 expert's few rows on int8 activations (VNNI's iqgemm, exactly its
rows), and more rows on its codes dequantised for the AMX-BF16 tiles: the crossover the AMX table sets
(iqgemm_rows_i8 / iqgemm_rows_u4 in cpu_kernels/csrc/expert_isa_amx.cpp, measured with
benchmarks/bench_iqgemm_crossover.py). At and below it the AMX kernels give the AVX512-BF16 ones'
outputs bit for bit (the same VNNI products and epilogue, no tile); above it their bf16 path's."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_reference import ActSpec
from tests.test_expert_kernels import HAS_CPP, INT_CASES, INT_IDS, _case, _has_vnni, _reference

# The AMX table's crossovers: an expert with up to this many rows takes iqgemm.
CROSSOVER = {"int8": 10, "int4": 10}


@pytest.fixture
def amx():
    if not HAS_CPP or torch.ops.moelight.set_isa("amx") != "amx" or not _has_vnni():
        torch.ops.moelight.set_isa("auto")
        pytest.skip("needs the AMX kernels (and AVX512-VNNI)")
    yield
    torch.ops.moelight.set_isa("auto")


def _rows_each(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens, each on experts 1 and 3: n rows per expert."""
    return torch.tensor([[1, 3]] * n), torch.rand(n, 2, generator=torch.Generator().manual_seed(n))


def _mix(isa: str, x, ids, weights, packed, act, int8_activations: bool = True) -> torch.Tensor:
    torch.ops.moelight.set_isa(isa)
    old = dispatch.INT8_ACTIVATIONS
    dispatch.INT8_ACTIVATIONS = int8_activations
    try:
        return dispatch.expert_mix(x, ids, weights, packed, act)
    finally:
        dispatch.INT8_ACTIVATIONS = old


@pytest.mark.parametrize("shape,fmt", INT_CASES, ids=INT_IDS)
def test_amx_takes_iqgemm_up_to_its_crossover(amx, shape, fmt):
    name, e, k, h, f, clamped = shape
    *_, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    limit = CROSSOVER[fmt]
    for n in (1, 3, limit, limit + 1, 40):
        ids, weights = _rows_each(n)
        x = (torch.randn(n, h, generator=torch.Generator().manual_seed(n)) * (3.0 if clamped else 1.0)).bfloat16()
        got = _mix("amx", x, ids, weights, packed, act)
        vnni = _mix("avx512bf16", x, ids, weights, packed, act)
        tiles = _mix("amx", x, ids, weights, packed, act, int8_activations=False)
        assert not torch.equal(vnni, tiles), f"{name} {fmt}, {n} rows: the two paths should differ"
        expected, other = (vnni, "VNNI's products") if n <= limit else (tiles, "the AMX-BF16 path")
        assert torch.equal(got, expected), f"{name} {fmt}, {n} rows per expert on AMX: not {other}"


@pytest.mark.parametrize("shape,fmt", INT_CASES, ids=INT_IDS)
def test_amx_mixed_row_counts_match_the_reference(amx, shape, fmt):
    """One call whose experts fall on both sides of the crossover (and row counts that are not
    multiples of a tile's 16): each expert's rows on its own path, within bf16's precision of the
    dequantize-then-matmul reference."""
    name, e, k, h, f, clamped = shape
    m13, m2, b13, b2, packed = _case(shape, fmt)
    act = ActSpec(1, 7.0, 1.702) if clamped else ActSpec()
    t = 25
    ids = torch.stack([torch.tensor([0, 1]) if i < 3 else torch.tensor([2, 1]) for i in range(t)])
    counts = torch.bincount(ids.flatten())
    assert counts[0] <= CROSSOVER[fmt] < counts[2] and counts[1] == t  # 3, 22 and 25 rows
    weights = torch.rand(t, 2, generator=torch.Generator().manual_seed(7))
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(8)) * (3.0 if clamped else 1.0)).bfloat16()
    got = _mix("amx", x, ids, weights, packed, act).double()
    ref = _reference(x, ids, weights, m13, m2, b13, b2, act)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, f"{name} {fmt}: relative error {err:.4f}"
