"""Experts packed into the kernel's strips by the C++ packer (csrc/expert_pack.cpp): the bytes of
`expert_pack.pack_experts` (the torch reference), in one pass from the canonical codes and scales straight
into the `alloc` buffers.

Why: the torch formulation pads, interleaves gate and up rows, unpacks 4-bit codes to a byte each, permutes
and ORs them back, through ~6 full-size temporaries: ~1.5 s and ~1 GB of transient memory for one
Qwen3-30B-A3B int4 layer (306 MiB packed) on 2 cores, ~70 s of a 48-layer load. The C++ pass is bound by
writing the output. Callers go through `cpu_kernels.pack_experts` (dispatch.py), which falls back to the
reference where the C++ kernels do not load.
"""

from __future__ import annotations

import torch

from cpu_kernels.expert_pack import (
    NIBBLE_FORMATS,
    STRIP,
    Alloc,
    PackedExperts,
    QuantMatrix,
    ceil_to,
    experts_layout,
    finish_packed,
    torch_alloc,
)


def gate_up_rows(f: int, f_pad: int) -> torch.Tensor:
    """Source row of each packed gate_up row [2 f_pad]: per 32-row strip 16 gate rows (g) then the matching 16
    up rows (f + g); -1 (a zero row) past f."""
    r = torch.arange(2 * f_pad)
    g = r // STRIP * 16 + r % 16
    src = torch.where(r % STRIP < 16, g, f + g)
    return torch.where(g < f, src, -1)


def plain_rows(n: int, n_pad: int) -> torch.Tensor:
    """Source row of each packed row [n_pad]: itself, -1 (a zero row) past n."""
    r = torch.arange(n_pad)
    return torch.where(r < n, r, -1)


def _strips(m: QuantMatrix, rows: torch.Tensor, k_pad: int, alloc: Alloc
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """One matrix's (codes [E, S, strip bytes], scales, additive terms [E, S, k_pad / group, 32], group)."""
    e, s, nib = m.codes.shape[0], rows.numel() // STRIP, m.fmt in NIBBLE_FORMATS
    codes = m.codes.contiguous()
    packed = alloc((e, s, k_pad // 2 * STRIP if nib else k_pad * STRIP), codes.dtype)
    torch.ops.moelight.pack_code_strips(codes, rows, k_pad, nib, packed)
    if m.fmt == "bf16":
        return packed, None, None, k_pad

    def per_strip(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = alloc((e, s, k_pad // m.group, STRIP), torch.float32)
        torch.ops.moelight.pack_group_strips(t.float().contiguous(), rows, k_pad // m.group, out)
        return out

    return packed, per_strip(m.scales), per_strip(m.bias), m.group


def pack_experts_native(gate_up: QuantMatrix, down: QuantMatrix, gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None, alloc: Alloc = torch_alloc) -> PackedExperts:
    """`expert_pack.pack_experts` by the C++ packer (the kernels must be loaded: dispatch.pack_experts)."""
    gate_up, down, f_pad, h_pad = experts_layout(gate_up, down)
    e, h, f = down.shape
    group = gate_up.group if gate_up.fmt != "bf16" else 0
    w13, s13, z13, g13 = _strips(gate_up, gate_up_rows(f, f_pad), ceil_to(h, max(group, STRIP)), alloc)
    group = down.group if down.fmt != "bf16" else 0
    w2, s2, z2, g2 = _strips(down, plain_rows(h, h_pad), ceil_to(f_pad, max(group, STRIP)), alloc)
    return finish_packed((w13.view(e, f_pad // 16, -1), s13, z13, g13), (w2, s2, z2, g2), gate_up, down,
                         gate_up_bias, down_bias, f_pad)
