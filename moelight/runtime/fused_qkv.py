"""One small_linear call for a decode step's q, k and v projections (bf16 layers that keep plain weights).

At one row each projection is a read of its weight plus a call's fixed cost (a parallel region, the
dispatch); GQA's k and v weights are small (0.5 MB on bench-1b), so three calls cost ~1.5x one call
over the three weights stacked (measured on the AMX host: 2.6 against 1.7 ms for bench-1b's 8 layers).
The stacked weight lives on huge pages and the three PackedLinears' plain weights become views of it,
so no weight is held twice. Each output element is the same dot product either way: the same numbers.
"""

from __future__ import annotations

import torch

from cpu_kernels import dispatch
from moelight.runtime.host_memory import huge_copy


class FusedQKV:
    """Attention.fused_qkv: h [T, K] with at most `rows` rows -> (q, k, v) from one matmul, else None."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int], rows: int) -> None:
        self.weight, self.bias, self.sizes, self.rows = weight, bias, sizes, rows

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        if h.numel() > self.rows * self.weight.shape[1]:
            return None
        return tuple(dispatch.small_linear(h, self.weight, self.bias).split(self.sizes, dim=-1))


def fuse_qkv(attn, huge_pages: bool = True) -> bool:
    """Give `attn` (an Attention whose q/k/v are PackedLinear) a FusedQKV over its plain bf16 weights (on
    huge pages with `huge_pages`); False (nothing changed) where they keep none, differ in rows they serve,
    or only some have a bias."""
    projs = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(getattr(p, "weight_bf16", None) is not None for p in projs):
        return False
    rows = {p.plain_rows for p in projs}
    biased = {p.bias is not None for p in projs}
    if len(rows) != 1 or len(biased) != 1:
        return False
    weight = torch.cat([p.weight_bf16 for p in projs])
    weight = huge_copy(weight) if huge_pages else weight
    bias = torch.cat([p.bias for p in projs]) if biased == {True} else None
    sizes = [p.weight_bf16.shape[0] for p in projs]
    for p, w in zip(projs, weight.split(sizes), strict=True):
        p.weight_bf16 = w  # contiguous row blocks of the stacked weight
    attn.fused_qkv = FusedQKV(weight, bias, sizes, rows.pop())
    return True
