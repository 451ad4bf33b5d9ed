"""Dummy dense routed experts are drawn as uniform 16-bit levels (loading/dummy_values.py); the routers and
everything else keep uniform_, and the same seed gives the same weights."""

from __future__ import annotations

import torch

from moelight.loading.dummy_values import uniform_levels_
from moelight.loading.weights import dummy_fill


def test_levels_are_uniform_in_the_bound_with_the_std_of_the_old_draw():
    t = uniform_levels_(torch.empty(3, 1000, 1001, dtype=torch.bfloat16), 0.0346, torch.Generator().manual_seed(0))
    v = t.float()
    assert abs(float(v.std()) - 0.0346 / 3**0.5) < 2e-4 and abs(float(v.mean())) < 2e-4
    assert float(v.abs().max()) <= 0.0346 * 1.004  # bf16 rounding of the bound
    hist = torch.histc(v, bins=10, min=-0.0346, max=0.0346)
    assert float(hist.min()) > 0.95 * float(hist.mean())


def test_dummy_fill_draws_experts_as_levels_and_routers_with_uniform():
    def drawn(name: str, shape) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.bfloat16)
        dummy_fill(name, t, torch.Generator().manual_seed(3))
        return t

    experts = drawn("layers.1.mlp.gate_up_proj", (2, 64, 32))
    want = uniform_levels_(torch.empty(2, 64, 32, dtype=torch.bfloat16), 0.0346, torch.Generator().manual_seed(3))
    assert torch.equal(experts, want) and torch.equal(experts, drawn("layers.1.mlp.gate_up_proj", (2, 64, 32)))
    router = drawn("layers.1.mlp.gate.weight", (8, 32))
    assert torch.equal(router, torch.empty(8, 32, dtype=torch.bfloat16).uniform_(
        -0.0346, 0.0346, generator=torch.Generator().manual_seed(3)))
