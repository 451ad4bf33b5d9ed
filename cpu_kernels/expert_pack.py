"""Expert weights in the fused kernel's layout (csrc/experts.h), and their dequantised form.

A layer's experts are two matrices per expert: gate_up [2f, h] (gate rows, then up rows) and down
[h, f]. Before packing they are in a canonical form, `QuantMatrix`: one code per element (bf16
values, int8, float8 e4m3 bytes, or 4-bit codes two to a byte along K) and, for quantized formats,
a scale (and optionally an additive term) per output row and group of K. `pack_experts` cuts them
into strips of 32 output columns in pair layout; gate_up strips hold 16 gate and the matching 16
up columns, so the kernel's epilogue sees both halves of the activation together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (shape, dtype) -> an uninitialised tensor: where pack_experts puts the arrays the kernel keeps (the caller
# may want them on huge pages, say); the intermediates stay on torch's allocator
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def torch_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)

FORMATS = {"bf16": 0, "int8": 1, "fp8": 2, "uint4": 3, "mxfp4": 4}
NIBBLE_FORMATS = ("uint4", "mxfp4")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
STRIP = 32


@dataclass
class QuantMatrix:
    """E matrices [N, K] in a weight format: w = lut(code) * scale + bias per (row, group of K).

    codes: bf16 [E, N, K] ('bf16'); int8 [E, N, K] ('int8'); uint8 e4m3 bits [E, N, K] ('fp8');
    uint8 [E, N, K/2] with k even in the low nibble ('uint4': 0..15, 'mxfp4': e2m1).
    scales / bias: float32 [E, N, K / group] (None for 'bf16'; bias None: w = lut(code) * scale).
    """

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    group: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.codes.shape
        return e, n, k * (2 if self.fmt in NIBBLE_FORMATS else 1)

    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in (self.scales, self.bias) if t is not None)
        return self.codes.numel() * self.codes.element_size() + extra

    def rows(self, index) -> QuantMatrix:
        """The same format over a selection of experts / rows (codes[index] and its scales)."""
        return QuantMatrix(self.fmt, self.codes[index], _pick(self.scales, index), _pick(self.bias, index), self.group)


def _pick(t: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if t is None else t[index]


def code_values(fmt: str, codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of every code (4-bit codes unpacked along the last axis)."""
    if fmt == "bf16":
        return codes.float()
    if fmt == "int8":
        return codes.float()
    if fmt == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    lut = torch.tensor(E2M1 if fmt == "mxfp4" else list(range(16)), dtype=torch.float32)
    low, high = lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]
    return torch.stack((low, high), dim=-1).flatten(-2)


def dequantize(m: QuantMatrix) -> torch.Tensor:
    """float32 [E, N, K]: the reference every quantized kernel path is checked against."""
    v = code_values(m.fmt, m.codes)
    if m.fmt == "bf16":
        return v
    s = m.scales.float().repeat_interleave(m.group, dim=-1)
    b = 0.0 if m.bias is None else m.bias.float().repeat_interleave(m.group, dim=-1)
    return v * s + b


@dataclass
class PackedExperts:
    """A layer's experts in strips (what torch.ops.moelight.expert_mix reads)."""

    w13: torch.Tensor  # [E, fp / 16, strip bytes]
    s13: torch.Tensor | None
    z13: torch.Tensor | None
    w2: torch.Tensor  # [E, hp / 32, strip bytes]
    s2: torch.Tensor | None
    z2: torch.Tensor | None
    fmt13: str
    group13: int
    fmt2: str
    group2: int
    hidden: int
    intermediate: int
    bias13: torch.Tensor | None = None  # float32 [E, fp / 16, 32] (gate / up biases in strip order)
    bias2: torch.Tensor | None = None  # float32 [E, hp]

    def nbytes(self) -> int:
        ts = (self.w13, self.s13, self.z13, self.w2, self.s2, self.z2, self.bias13, self.bias2)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _pad(t: torch.Tensor | None, n: int, k: int) -> torch.Tensor | None:
    """Zero-pad [E, N, K] to [E, n, k]."""
    if t is None:
        return None
    return torch.nn.functional.pad(t, (0, k - t.shape[2], 0, n - t.shape[1]))


def _into(alloc: Alloc, shape: tuple[int, ...], value: torch.Tensor) -> torch.Tensor:
    """`value` (any strides) written once into a fresh `alloc` buffer of `shape`."""
    out = alloc(tuple(shape), value.dtype)
    out.view(value.shape).copy_(value)
    return out


def _strips(m: QuantMatrix, n_pad: int, alloc: Alloc = torch_alloc
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
    """[E, N, K] in canonical form -> (codes [E, S, bytes], scales, bias [E, S, K/g, 32], group)."""
    e, n, k = m.shape
    group = m.group if m.fmt != "bf16" else 0
    k_pad = ceil_to(k, max(group, STRIP))
    nib = m.fmt in NIBBLE_FORMATS
    codes = _pad(m.codes, n_pad, k_pad // 2 if nib else k_pad)
    s = n_pad // STRIP
    if nib:
        values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)  # [E, n, k] of 0..15
    else:
        values = codes
    rows = values.view(e, s, STRIP, k_pad // 2, 2).permute(0, 1, 3, 2, 4)  # [E, S, K/2, 32, 2]
    if nib:  # byte i of a row: element i (low nibble), element i + 32 (high)
        rows = rows.reshape(e, s, k_pad // 2, 2 * STRIP)
        packed = alloc((e, s, k_pad // 2 * STRIP), torch.uint8)
        torch.bitwise_or(rows[..., :STRIP], rows[..., STRIP:] << 4, out=packed.view(e, s, k_pad // 2, STRIP))
    else:
        packed = _into(alloc, (e, s, k_pad * STRIP), rows)
    if m.fmt == "bf16":
        return packed, None, None, k_pad

    def per_strip(t):
        if t is None:
            return None
        t = _pad(t.float(), n_pad, k_pad // group).view(e, s, STRIP, -1).permute(0, 1, 3, 2)
        return _into(alloc, t.shape, t)

    return packed, per_strip(m.scales), per_strip(m.bias), group


def _gate_up_order(t: torch.Tensor | None, f: int, f_pad: int) -> torch.Tensor | None:
    """[E, 2f, ...] (gate rows, up rows) -> [E, 2 f_pad, ...] with 16 gate rows then 16 up rows per strip."""
    if t is None:
        return None
    pad = [0, 0] * (t.dim() - 2) + [0, f_pad - f]
    gate, up = torch.nn.functional.pad(t[:, :f], pad), torch.nn.functional.pad(t[:, f:], pad)
    e, rest = t.shape[0], t.shape[2:]
    both = torch.stack((gate.reshape(e, f_pad // 16, 16, *rest), up.reshape(e, f_pad // 16, 16, *rest)), dim=2)
    return both.reshape(e, 2 * f_pad, *rest)


def pack_experts(gate_up: QuantMatrix, down: QuantMatrix, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, alloc: Alloc = torch_alloc) -> PackedExperts:
    """gate_up [E, 2f, h] and down [E, h, f] (canonical, any format) -> the kernel's strips. The codes,
    scales and additive terms are written straight into buffers from `alloc` (no copy afterwards).
    The pure-torch reference: `cpu_kernels.pack_experts` (dispatch.py) packs the same bytes in C++."""
    gate_up, down, f_pad, h_pad = experts_layout(gate_up, down)
    e, f, h = down.shape[0], down.shape[2], down.shape[1]
    ordered = QuantMatrix(gate_up.fmt, _gate_up_order(gate_up.codes, f, f_pad),
                          _gate_up_order(gate_up.scales, f, f_pad), _gate_up_order(gate_up.bias, f, f_pad),
                          gate_up.group)
    w13, s13, z13, g13 = _strips(ordered, 2 * f_pad, alloc)
    w13 = w13.view(e, f_pad // 16, -1)  # 32-column strips: f_pad / 16 of them
    if down.shape[2] != f_pad:  # the down matrix's K must be the padded intermediate width
        down = QuantMatrix(down.fmt, _pad(down.codes, h, f_pad // 2 if down.fmt in NIBBLE_FORMATS else f_pad),
                           _pad(down.scales, h, f_pad // down.group) if down.scales is not None else None,
                           _pad(down.bias, h, f_pad // down.group) if down.bias is not None else None, down.group)
    w2, s2, z2, g2 = _strips(down, h_pad, alloc)
    return finish_packed((w13, s13, z13, g13), (w2, s2, z2, g2), gate_up, down, gate_up_bias, down_bias, f_pad)


def experts_layout(gate_up: QuantMatrix, down: QuantMatrix) -> tuple[QuantMatrix, QuantMatrix, int, int]:
    """Checked shapes -> (gate_up, down with their kernel groups, f and h padded to whole strips)."""
    e, two_f, h = gate_up.shape
    f = two_f // 2
    if down.shape != (e, h, f):
        raise ValueError(f"down {down.shape} does not match gate_up {gate_up.shape}")
    f_pad, h_pad = ceil_to(f, STRIP), ceil_to(h, STRIP)
    return _whole_k_group(gate_up, h_pad), _whole_k_group(down, f_pad), f_pad, h_pad


def finish_packed(gu: tuple, dn: tuple, gate_up: QuantMatrix, down: QuantMatrix, gate_up_bias: torch.Tensor | None,
                  down_bias: torch.Tensor | None, f_pad: int) -> PackedExperts:
    """PackedExperts from the packed (codes, scales, bias, group) of both matrices, plus the biases (small)."""
    e, h, f = down.shape[0], down.shape[1], gate_up.shape[1] // 2
    h_pad = ceil_to(h, STRIP)
    b13 = None if gate_up_bias is None else _gate_up_order(gate_up_bias.float().unsqueeze(-1), f, f_pad)
    b2 = None if down_bias is None else torch.nn.functional.pad(down_bias.float(), (0, h_pad - h))
    return PackedExperts(gu[0], gu[1], gu[2], dn[0], dn[1], dn[2], gate_up.fmt, gu[3], down.fmt, dn[3], h, f,
                         None if b13 is None else b13.reshape(e, f_pad // 16, 32).contiguous(),
                         None if b2 is None else b2.contiguous())


def _whole_k_group(m: QuantMatrix, k_pad: int) -> QuantMatrix:
    """One scale along all of K (int8 per channel, a checkpoint's group -1): the kernel's group is then K
    padded to whole strips (the padded columns are zero), a multiple of 32 as its groups must be."""
    if m.fmt == "bf16" or m.group != m.shape[2] or m.group == k_pad:
        return m
    return QuantMatrix(m.fmt, m.codes, m.scales, m.bias, k_pad)


def bf16_matrix(w: torch.Tensor) -> QuantMatrix:
    return QuantMatrix("bf16", w.to(torch.bfloat16).contiguous())
