"""A layer's routed experts held in a quantized format (models/expert_format.py) from load on.

`QuantizedExperts` stands where a MoE block's `gate_up_proj` [E, 2f, h] or `down_proj` [E, h, f]
parameter would be. To the loader it looks like that parameter (moelight/loading/weights.py): it has
the logical shape, and `experts[index].copy_(x)` takes either a dense tensor, quantized on the spot
(`--quantize int8|int4`: round-to-nearest is row-local, so quantizing one checkpoint tensor at a
time gives what quantizing the whole matrix would), or a `QuantPiece` already in the format (a
checkpoint's MXFP4 blocks, FP8 codes), copied as it is. So every family's weight map works
unchanged and memory never holds the 16-bit experts. `runtime/fused_experts.py` packs `matrix()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cpu_kernels.expert_pack import NIBBLE_FORMATS, QuantMatrix
from cpu_kernels.expert_quant import quantize_int4, quantize_int8
from moelight.models.expert_format import ExpertFormat

_CODE_DTYPE = {"int8": torch.int8, "fp8": torch.uint8, "uint4": torch.uint8, "mxfp4": torch.uint8}
# dummy weights: a scale that gives the values the std of HF's initialisation (0.02)
_DUMMY_SCALE = {"int8": 0.02 / 73.3, "uint4": 0.02 / 4.6, "mxfp4": 2.0**-7, "fp8": 0.0346}


@dataclass
class QuantPiece:
    """Part of a quantized matrix as a checkpoint ships it: codes [..., K or K/2] and float32 scales
    (and additive terms) [..., K / group] over the same leading (expert, row) dimensions."""

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        k = self.codes.shape[-1] * (2 if self.fmt in NIBBLE_FORMATS else 1)
        return (*self.codes.shape[:-1], k)

    def __getitem__(self, index) -> QuantPiece:
        """A selection of leading (expert, row) dimensions: the same selection of codes and scales."""
        offsets = None if self.offsets is None else self.offsets[index]
        return QuantPiece(self.fmt, self.codes[index], self.scales[index], offsets)


def _frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantizedExperts(nn.Module):
    """E matrices [N, K] in `form`: codes, float32 scales per (row, group) and, with `form.zero`,
    float32 additive terms (w = code * scale + offset)."""

    def __init__(self, form: ExpertFormat, experts: int, n: int, k: int) -> None:
        super().__init__()
        self.form, self.k, self.group = form, k, form.group_of(k)
        if k % self.group:
            raise ValueError(f"expert width {k} is not a multiple of the {form.fmt} group size {self.group}")
        width = k // 2 if form.fmt in NIBBLE_FORMATS else k
        self.codes = _frozen(experts, n, width, dtype=_CODE_DTYPE[form.fmt])
        self.scales = _frozen(experts, n, k // self.group, dtype=torch.float32)
        self.offsets = _frozen(experts, n, k // self.group, dtype=torch.float32) if form.zero else None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.codes.shape[0], self.codes.shape[1], self.k)

    def __len__(self) -> int:
        return self.codes.shape[0]

    def numel(self) -> int:
        """Logical elements (what the loader counts as filled)."""
        e, n, k = self.shape
        return e * n * k

    def __getitem__(self, index) -> QuantizedView:
        return QuantizedView(self, index if isinstance(index, tuple) else (index,))

    def matrix(self) -> QuantMatrix:
        """The kernels' canonical form (cpu_kernels/expert_pack.py)."""
        return QuantMatrix(self.form.fmt, self.codes.data, self.scales.data,
                           None if self.offsets is None else self.offsets.data, self.group)

    def nbytes(self) -> int:
        return self.matrix().nbytes()

    @torch.no_grad()
    def fill_dummy(self, gen: torch.Generator) -> None:
        """Random codes with a scale that gives values of std ~0.02, as dummy dense weights have."""
        fmt = self.form.fmt
        if fmt == "fp8":  # random e4m3 bytes include NaNs: draw values and convert instead
            self.codes.copy_(torch.empty(self.codes.shape).uniform_(-1, 1, generator=gen)
                             .to(torch.float8_e4m3fn).view(torch.uint8))
        else:
            random_bytes(self.codes.data, gen)
            if fmt == "int8":
                self.codes.clamp_(min=-127)  # the symmetric range round-to-nearest gives
        self.scales.fill_(_DUMMY_SCALE[fmt])
        if self.offsets is not None:
            self.offsets.fill_(-8.0 * _DUMMY_SCALE[fmt] if fmt == "uint4" else 0.0)


def random_bytes(t: torch.Tensor, gen: torch.Generator) -> None:
    """Every byte of 1-byte tensor `t` uniform over its 256 values. Drawn 8 at a time as int64 where `t` allows:
    one draw per byte (random_(0, 256)) took ~1 s per Qwen3-30B-A3B int4 layer (300 MB) on 2 cores, against
    ~0.18 s (a 48-layer load: ~45 s against ~9 s)."""
    if t.is_contiguous() and t.numel() % 8 == 0 and t.data_ptr() % 8 == 0:
        t.view(torch.int64).random_(-2**63, 2**63 - 1, generator=gen)  # (2**63 - 1 itself never drawn)
    else:
        t.random_(-128 if t.dtype == torch.int8 else 0, 128 if t.dtype == torch.int8 else 256, generator=gen)


class QuantizedView:
    """`experts[index]`: what the loader's copy writes into (a parameter slice's shape and copy_)."""

    def __init__(self, experts: QuantizedExperts, index: tuple) -> None:
        self.experts, self.index = experts, index
        self.shape = (*experts.codes[index].shape[:-1], experts.k)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @torch.no_grad()
    def copy_(self, value: torch.Tensor | QuantPiece) -> None:
        piece = value if isinstance(value, QuantPiece) else self._quantize(value)
        ex, form = self.experts, self.experts.form
        if piece.fmt != form.fmt or piece.scales.shape[-1] != ex.scales.shape[-1]:
            raise ValueError(f"a {piece.fmt} piece with {piece.scales.shape[-1]} scale groups per row does not "
                             f"fit experts held as {form.fmt} with {ex.scales.shape[-1]}")
        ex.codes[self.index].copy_(piece.codes.view(ex.codes.dtype))
        ex.scales[self.index].copy_(piece.scales)
        if ex.offsets is not None:
            ex.offsets[self.index].copy_(piece.offsets if piece.offsets is not None else torch.zeros(()))

    def _quantize(self, dense: torch.Tensor) -> QuantPiece:
        """Round-to-nearest, row by row, into the experts' own format (int8 or uint4)."""
        ex = self.experts
        if ex.form.fmt not in ("int8", "uint4"):
            raise ValueError(f"dense weights cannot be written into experts held as {ex.form.fmt}")
        rows = dense.reshape(1, -1, dense.shape[-1])
        m = quantize_int8(rows) if ex.form.fmt == "int8" else quantize_int4(rows, ex.group)
        lead = dense.shape[:-1]
        return QuantPiece(m.fmt, m.codes.reshape(*lead, -1), m.scales.reshape(*lead, -1),
                          None if m.bias is None else m.bias.reshape(*lead, -1))


def hold_experts_quantized(model: nn.Module, form: ExpertFormat) -> None:
    """Replace every MoE block's `gate_up_proj` / `down_proj` parameter by `QuantizedExperts` (call it
    on the meta device, before the model's memory is allocated)."""
    for layer in model.layers:
        moe = layer.mlp
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(moe, name, None)
            if isinstance(w, nn.Parameter) and w.dim() == 3:
                e, n, k = w.shape
                delattr(moe, name)
                setattr(moe, name, QuantizedExperts(form, e, n, k))


def held_quantized(model: nn.Module) -> tuple[QuantizedExperts, QuantizedExperts] | None:
    """(gate_up, down) of the first MoE layer when the model holds its experts quantized, else None
    (every MoE layer holds them alike)."""
    cfg = model.config
    mlp = next((layer.mlp for j, layer in enumerate(model.layers) if cfg.is_sparse(j)), None)
    if mlp is None or not isinstance(mlp.gate_up_proj, QuantizedExperts):
        return None
    return mlp.gate_up_proj, mlp.down_proj


def routed_expert_param(name: str) -> bool:
    """A parameter of the routed experts (`...mlp.gate_up_proj`, or a part of one held quantized)."""
    return any(name.endswith(f"mlp.{m}") or f"mlp.{m}." in name for m in ("gate_up_proj", "down_proj"))


def quantized_experts_of(model: nn.Module) -> dict[str, QuantizedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedExperts)}
