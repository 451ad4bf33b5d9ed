"""A layer's routed experts as contiguous stacks in one flat byte buffer, and their dequantization.

The weight pager moves bytes: a layer's paged experts, read in place as one flat buffer of the
layout (`segments`, `gather`), are cut into pages, copied to a device slot of the same layout.
`StackLayout` says where each stack lies:
16-bit experts are two stacks (gate_up [n, 2f, h], down [n, h, f]); quantized experts
(`--quantize int8|int4`, models/quantized_experts.py) are their codes, scales and offsets, so the
link carries a quarter (int4) or half (int8) of the 16-bit bytes. A GPU runs its GEMMs in the
run's dtype: either the fused dequant-GEMM multiplies the quantized stacks directly (models/fused_dequant.py:
CUDA with triton; `runs_fused` says whether a run does), or `dequantize_stacks` expands them into dense
ones on the device first (torch ops, chunked so the float32 temporaries stay small), computing what
`cpu_kernels.expert_pack.dequantize` computes, so a device run matches a dense model holding the
dequantized weights. The fused kernel rounds each weight the same way, in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelight.models.expert_format import ExpertFormat
from moelight.models.fused_dequant import QuantizedStack, expand_rows, use_fused
from moelight.models.quantized_experts import QuantizedExperts, held_quantized

_ALIGN = 64  # bytes: every stack starts aligned for any element type
CHUNK_ELEMENTS = 1 << 20  # weights dequantized at once
DEQUANTIZE_SCRATCH = 40 * CHUNK_ELEMENTS  # device bytes of its temporaries (nibbles as int64, float32 values)


@dataclass(frozen=True)
class Stack:
    name: str  # 'gate_up', 'down' or, quantized, 'gate_up.codes', 'down.scales', ...
    dtype: torch.dtype
    shape: tuple[int, ...]  # one expert's
    offset: int  # bytes from the buffer's start, for expert 0

    def nbytes(self, n: int) -> int:
        count = n
        for d in self.shape:
            count *= d
        return count * torch.empty((), dtype=self.dtype).element_size()


class StackLayout:
    """n experts of one layer: each stack [n, *shape] contiguous, stacks one after another."""

    def __init__(self, n: int, parts: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 form: ExpertFormat | None = None, group: tuple[int, int] = (0, 0)) -> None:
        self.n, self.form, self.group = n, form, group
        self.stacks, at = [], 0
        for name, dtype, shape in parts:
            s = Stack(name, dtype, shape, at)
            self.stacks.append(s)
            at += -(-s.nbytes(n) // _ALIGN) * _ALIGN
        self.nbytes = at

    @classmethod
    def dense(cls, n: int, hidden: int, intermediate: int, dtype: torch.dtype) -> StackLayout:
        return cls(n, [("gate_up", dtype, (2 * intermediate, hidden)), ("down", dtype, (hidden, intermediate))])

    @classmethod
    def quantized(cls, n: int, gate_up: QuantizedExperts, down: QuantizedExperts) -> StackLayout:
        parts = []
        for side, q in (("gate_up", gate_up), ("down", down)):
            parts += [(f"{side}.{k}", t.dtype, tuple(t.shape[1:])) for k, t in _parts(q).items()]
        return cls(n, parts, gate_up.form, (gate_up.group, down.group))

    def quantized_stacks(self, views: dict[str, torch.Tensor], dtype: torch.dtype
                         ) -> tuple[QuantizedStack, QuantizedStack]:
        """(gate_up, down) of a quantized layout's views, as the fused dequant-GEMM takes them."""
        return tuple(QuantizedStack.of(views, side, self.form.fmt, group, dtype)
                     for side, group in zip(("gate_up", "down"), self.group, strict=True))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each stack of a flat uint8 buffer of `nbytes`, viewed as its [n, *shape] tensor."""
        out = {}
        for s in self.stacks:
            raw = flat[s.offset: s.offset + s.nbytes(self.n)]
            out[s.name] = raw.view(s.dtype).view(self.n, *s.shape)
        return out

    def fill(self, flat: torch.Tensor, gate_up, down, first: int) -> None:
        """Copy experts first .. first + n - 1 of a layer (dense tensors or QuantizedExperts) in."""
        sources = _sources(gate_up, down)
        for name, view in self.views(flat).items():
            view.copy_(sources[name][first: first + self.n])

    def segments(self, gate_up, down, first: int) -> list[tuple[int, torch.Tensor]]:
        """Experts first .. first + n - 1 as (offset in the layout, their bytes) without a copy: views of the
        model's own tensors (a CPU pager reads its pages from them rather than from a second copy)."""
        sources = _sources(gate_up, down)
        return [(s.offset, sources[s.name][first: first + self.n].contiguous().reshape(-1).view(torch.uint8))
                for s in self.stacks]


def gather(segments: list[tuple[int, torch.Tensor]], start: int, out: torch.Tensor) -> None:
    """Bytes [start, start + len(out)) of a layout held as `segments` into `out` (padding left as is)."""
    end = start + out.numel()
    for at, raw in segments:
        lo, hi = max(start, at), min(end, at + raw.numel())
        if lo < hi:
            out[lo - start: hi - start].copy_(raw[lo - at: hi - at])


def _sources(gate_up, down) -> dict[str, torch.Tensor]:
    sources = {}
    for side, w in (("gate_up", gate_up), ("down", down)):
        if isinstance(w, QuantizedExperts):
            sources |= {f"{side}.{k}": t for k, t in _parts(w).items()}
        else:
            sources[side] = w.detach()
    return sources


def _parts(q: QuantizedExperts) -> dict[str, torch.Tensor]:
    parts = {"codes": q.codes.detach(), "scales": q.scales.detach()}
    if q.offsets is not None:
        parts["offsets"] = q.offsets.detach()
    return parts


def dequantize_stacks(layout: StackLayout, views: dict[str, torch.Tensor], gate_up_out: torch.Tensor,
                      down_out: torch.Tensor) -> None:
    """Quantized stacks (on the device) -> dense [n, 2f, h] and [n, h, f] in the outputs' dtype."""
    for side, out, group in (("gate_up", gate_up_out, layout.group[0]), ("down", down_out, layout.group[1])):
        codes, scales = views[f"{side}.codes"], views[f"{side}.scales"]
        offsets = views.get(f"{side}.offsets")
        rows = max(1, CHUNK_ELEMENTS // out.shape[-1])
        for e in range(layout.n):
            for r in range(0, out.shape[1], rows):
                sl = slice(r, r + rows)
                rows_offsets = None if offsets is None else offsets[e, sl]
                out[e, sl].copy_(expand_rows(layout.form.fmt, codes[e, sl], scales[e, sl], rows_offsets, group))


def runs_fused(model, device) -> bool:
    """Whether a runtime on `device` (a Device, a torch.device or a kind: 'emulated', 'cuda') multiplies the
    model's quantized experts with the fused dequant-GEMM (no dense buffer, no expansion pass) rather
    than expanding them; False for 16-bit experts."""
    held = held_quantized(model)
    if held is None:
        return False
    if isinstance(device, str):
        device = torch.device("cpu" if device == "emulated" else device)
    elif not isinstance(device, torch.device):
        device = device.torch_device
    gu, dn = held
    return use_fused(device, model.embed_tokens.weight.dtype, gu.form.fmt, (gu.k, dn.k), (gu.group, dn.group))
