"""pack_experts writes the arrays the kernel keeps straight into its caller's buffers (`alloc`), and the
engine packs experts straight onto huge pages instead of packing on 4 KiB pages and copying."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cpu_kernels.expert_pack import bf16_matrix, pack_experts
from cpu_kernels.expert_quant import quantize
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.runtime import cpu_linear, fused_experts, host_memory
from moelight.runtime.host_memory import HUGE_PAGE

KEPT = ("w13", "s13", "z13", "w2", "s2", "z2")


def _matrices(fmt: str, e: int = 3, f: int = 64, h: int = 96):
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * f, h, generator=g), torch.randn(e, h, f, generator=g)
    if fmt == "bf16":
        return bf16_matrix(w13), bf16_matrix(w2)
    return quantize(w13, fmt, 32), quantize(w2, fmt, 32)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_pack_experts_fills_the_callers_buffers_with_the_same_bytes(fmt):
    given = []

    def alloc(shape, dtype):
        given.append(torch.full(shape, 7, dtype=dtype))  # garbage: every byte must be written
        return given[-1]

    plain = pack_experts(*_matrices(fmt))
    into = pack_experts(*_matrices(fmt), alloc=alloc)
    for name in KEPT:
        a, b = getattr(plain, name), getattr(into, name)
        if a is None:
            assert b is None
            continue
        assert any(b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in given), name
        assert a.shape == b.shape and a.dtype == b.dtype and b.is_contiguous()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.skipif(not host_memory.huge_pages_available(), reason="needs Linux transparent huge pages")
def test_engine_packs_experts_onto_huge_pages_without_copying(monkeypatch):
    def no_copy(t):
        raise AssertionError("experts copied after packing")

    monkeypatch.setattr(host_memory, "huge_copy", no_copy)
    wide = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=1024, num_layers=1, vocab_size=512,
                   num_heads=16, num_kv_heads=4, head_dim=64, num_experts=2, top_k=2)
    moe = build_model(wide, torch.bfloat16, None, seed=0).layers[0].mlp
    packed = fused_experts.pack_moe(moe).packed
    assert packed.w13.data_ptr() % HUGE_PAGE == 0 and packed.w2.data_ptr() % HUGE_PAGE == 0
    assert cpu_linear.pack_moe is fused_experts.pack_moe  # what pack_model calls
