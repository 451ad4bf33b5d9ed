"""pack_model's PackedLinear(consume=True) drops the replaced layer's weight before packing (two copies of an LM
head alive at once, not three) and computes what the plain PackedLinear computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moelight.runtime import cpu_linear, host_memory


@pytest.mark.skipif(not cpu_linear.packing_supported(torch.bfloat16), reason="oneDNN packs no bf16 here")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_consumed_layer_gives_the_same_outputs(huge_pages):
    torch.manual_seed(0)
    lin = nn.Linear(1024, 1536, bias=False).to(torch.bfloat16)  # 3 MiB: over a huge page
    kept = cpu_linear.PackedLinear(lin, huge_pages=huge_pages)
    x = torch.randn(7, 1024, dtype=torch.bfloat16)
    want, want_row = kept(x), kept(x[:1])
    consumed = cpu_linear.PackedLinear(lin, huge_pages=huge_pages, consume=True)
    assert torch.equal(consumed(x), want) and torch.equal(consumed(x[:1]), want_row)
    if huge_pages and consumed.weight_bf16 is not None and host_memory.huge_pages_available():
        assert lin.weight.numel() == 0  # the layer's own copy is gone
