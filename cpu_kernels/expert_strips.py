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

from collections.abc import Callable

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


def _buffers(m: QuantMatrix, s: int, k_pad: int, alloc: Alloc
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One matrix's output arrays, unwritten: codes [E, S, strip bytes], scales and additive terms
    [E, S, k_pad / group, 32] (None where the format has none)."""
    e, nib = m.codes.shape[0], m.fmt in NIBBLE_FORMATS
    codes = alloc((e, s, k_pad // 2 * STRIP if nib else k_pad * STRIP), m.codes.dtype)
    if m.fmt == "bf16":
        return codes, None, None
    groups = (e, s, k_pad // m.group, STRIP)
    return (codes, alloc(groups, torch.float32) if m.scales is not None else None,
            alloc(groups, torch.float32) if m.bias is not None else None)


def _pack_expert(m: QuantMatrix, rows: torch.Tensor, k_pad: int, out: tuple, i: int) -> None:
    """Expert `i` of matrix `m` into its part of the `out` arrays (_buffers)."""
    one = slice(i, i + 1)
    torch.ops.moelight.pack_code_strips(m.codes[one].contiguous(), rows, k_pad, m.fmt in NIBBLE_FORMATS,
                                        out[0][one])
    for t, o in ((m.scales, out[1]), (m.bias, out[2])):
        if o is not None:
            torch.ops.moelight.pack_group_strips(t[one].float().contiguous(), rows, k_pad // m.group, o[one])


def _k_pad(m: QuantMatrix, k: int) -> int:
    return ceil_to(k, max(m.group if m.fmt != "bf16" else 0, STRIP))


def pack_experts_native(gate_up: QuantMatrix, down: QuantMatrix, gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None, alloc: Alloc = torch_alloc,
                        packed_through: Callable[[int], None] | None = None) -> PackedExperts:
    """`expert_pack.pack_experts` by the C++ packer (the kernels must be loaded: dispatch.pack_experts), one
    expert at a time: `packed_through(i)` runs once experts 0..i of both matrices are packed, so a caller that
    owns the sources can hand their pages back while the rest are packed (runtime/fused_experts.pack_moe: the
    load's transient is then one expert, not a layer's worth of new arrays beside the old)."""
    gate_up, down, f_pad, h_pad = experts_layout(gate_up, down)
    e, h, f = down.shape
    rows13, rows2 = gate_up_rows(f, f_pad), plain_rows(h, h_pad)
    k13, k2 = _k_pad(gate_up, h), _k_pad(down, f_pad)
    out13 = _buffers(gate_up, rows13.numel() // STRIP, k13, alloc)
    out2 = _buffers(down, rows2.numel() // STRIP, k2, alloc)
    for i in range(e):
        _pack_expert(gate_up, rows13, k13, out13, i)
        _pack_expert(down, rows2, k2, out2, i)
        if packed_through is not None:
            packed_through(i)
    g13 = gate_up.group if gate_up.fmt != "bf16" else k13
    g2 = down.group if down.fmt != "bf16" else k2
    return finish_packed((out13[0].view(e, f_pad // 16, -1), out13[1], out13[2], g13), (*out2, g2), gate_up, down,
                         gate_up_bias, down_bias, f_pad)
