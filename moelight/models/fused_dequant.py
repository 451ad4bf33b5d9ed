"""Grouped GEMMs over quantized expert stacks without expanding them (issue #34, item 4).

A runtime that holds a layer's experts quantized on a GPU (the weight pager's resident stacks and
paged slot) either expands them into dense [n, 2f, h] / [n, h, f] buffers before the grouped GEMMs
(the expand path: runtime/expert_stacks.dequantize_stacks) or, here, multiplies the codes directly
with a Triton kernel (models/dequant_gemm_kernel.py) that expands each K tile in registers: no dense
buffer, no extra pass over the weights. `QuantizedStack` is such a stack as a `GroupedExperts` group
holds it; `fused_linear` runs one over the expert-sorted rows.

Which path runs: `MOELIGHT_DEQUANT_GEMM` = `fused` | `expand` | `auto` (the default). `auto` takes the
fused kernel on CUDA where triton imports and a probe (once per device, dtype and format) matches
the expand path; on the CPU (the emulated device) it keeps the expand path. `fused` on the CPU runs
the kernel in Triton's interpreter (slow: tests only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moelight.models.mxfp4 import E2M1

FORMAT_CODES = {"int8": 0, "uint4": 1, "fp8": 2, "mxfp4": 3}  # dequant_gemm_kernel.FMT_*
NIBBLE_FORMATS = ("uint4", "mxfp4")
MODE_ENV = "MOELIGHT_DEQUANT_GEMM"
BLOCK_N = 64
Tiles = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]
_probed: dict[tuple[str, torch.dtype, str], bool] = {}


def code_values(fmt: str, codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of every code (4-bit codes unpacked along the last axis, low nibble first)."""
    if fmt == "int8":
        return codes.float()
    if fmt == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    low, high = (codes & 0x0F).long(), (codes >> 4).long()
    if fmt == "mxfp4":
        lut = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
        low, high = lut[low], lut[high]
    return torch.stack((low.float(), high.float()), dim=-1).flatten(-2)


def expand_rows(fmt: str, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                group: int) -> torch.Tensor:
    """Rows of one quantized matrix as float32 [rows, K]: value(code) * scale (+ offset) per group of K."""
    v = code_values(fmt, codes)
    g = v.view(v.shape[0], -1, group) * scales.unsqueeze(-1)
    if offsets is not None:
        g = g + offsets.unsqueeze(-1)
    return g.view(v.shape)


@dataclass(frozen=True)
class QuantizedStack:
    """n experts' [N, K] matrices held quantized: codes [n, N, K or K/2], float32 scales (and additive
    terms) [n, N, K / group]; `dtype` is the run's, which the GEMMs compute in."""

    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group: int
    dtype: torch.dtype

    @classmethod
    def of(cls, views: dict[str, torch.Tensor], side: str, fmt: str, group: int, dtype: torch.dtype
           ) -> QuantizedStack:
        """One side ('gate_up' or 'down') of a StackLayout's views (runtime/expert_stacks.py)."""
        return cls(fmt, views[f"{side}.codes"], views[f"{side}.scales"], views.get(f"{side}.offsets"), group, dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        n, rows, width = self.codes.shape
        return n, rows, width * (2 if self.fmt in NIBBLE_FORMATS else 1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """`F.linear(x, stack)` of a one-expert stack (an expert cache's slot, which the per-expert loop
        multiplies): the fused kernel over x's rows. Nothing else takes a stack."""
        x, w, *rest = args
        if func is not torch.nn.functional.linear or kwargs or rest or not isinstance(w, cls) or w.shape[0] != 1:
            return NotImplemented
        zero = torch.zeros(1, dtype=torch.int64, device=x.device)  # on the device: no copy, no sync
        return fused_linear(x, w, 0, zero, zero + x.shape[0])

    def __getitem__(self, e: int) -> torch.Tensor:
        """Expert e expanded [N, K] in the run's dtype (the per-expert loop's fallback)."""
        offsets = None if self.offsets is None else self.offsets[e]
        return expand_rows(self.fmt, self.codes[e], self.scales[e], offsets, self.group).to(self.dtype)


def block_k(k: int, group: int) -> int | None:
    """A K tile that lies inside one scale group (tl.dot wants >= 16), or None: the kernel cannot take it."""
    if group == k:  # one group a row (int8's per-channel scale)
        return 64
    for b in (64, 32, 16):
        if group % b == 0:
            return b
    return None


def mode() -> str:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "fused", "expand"):
        raise ValueError(f"{MODE_ENV}={value!r}: auto, fused or expand")
    return value


def use_fused(device: torch.device, dtype: torch.dtype, fmt: str, widths: tuple[int, ...],
              groups: tuple[int, ...]) -> bool:
    """Whether a runtime on `device` multiplies its quantized experts with the fused kernel (else it
    expands them first). widths: the matrices' K (hidden, expert width); groups: their group sizes."""
    m = mode()
    fits = fmt in FORMAT_CODES and all(block_k(k, g) for k, g in zip(widths, groups, strict=True))
    if m == "expand" or not fits:
        return False
    if m == "fused":
        return True
    return device.type == "cuda" and fused_supported(device, dtype, fmt)


def fused_supported(device: torch.device, dtype: torch.dtype, fmt: str) -> bool:
    """Whether triton imports and the fused kernel matches the expand path here (probed once per device,
    dtype and format: a compile error, e.g. a dtype the GPU's Triton cannot dot, says no)."""
    key = (str(device), dtype, fmt)
    if key not in _probed:
        try:
            _probed[key] = _probe(device, dtype, fmt)
        except Exception:  # noqa: BLE001 - any failure to import, compile or run means: expand instead
            _probed[key] = False
    return _probed[key]


def _probe(device: torch.device, dtype: torch.dtype, fmt: str) -> bool:
    gen = torch.Generator().manual_seed(0)
    n, N, K, group = 3, 48, 64, 32
    width = K // 2 if fmt in NIBBLE_FORMATS else K
    codes = torch.randint(0, 256, (n, N, width), generator=gen, dtype=torch.uint8)
    if fmt == "int8":
        codes = codes.view(torch.int8).clamp(min=-127)
    elif fmt == "fp8":
        codes = (torch.rand(n, N, width, generator=gen) * 2 - 1).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.rand(n, N, K // group, generator=gen) * 0.05 + 0.01
    stack = QuantizedStack(fmt, codes.to(device), scales.to(device), None, group, dtype)
    x = torch.randn(13, K, generator=gen).to(device, dtype)
    starts = torch.tensor([0, 5, 5], device=device)  # an expert without rows, a short tail
    ends = torch.tensor([5, 5, 11], device=device)
    ref = torch.cat([x[:5] @ stack[0].T, x[5:11] @ stack[2].T])
    gate, up = ref.chunk(2, dim=-1)
    ok = True
    for glu, want in ((False, ref), (True, torch.nn.functional.silu(gate) * up)):  # both specialisations
        got = fused_linear(x, stack, 0, starts, ends, glu=glu)[:11].float()
        ok &= bool(torch.allclose(got, want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max())))
    return ok


def tile_map(starts: torch.Tensor, ends: torch.Tensor, first: int, n: int, rows: int) -> Tiles:
    """(tile height, and the expert, first row and end row of every M tile) over experts first .. first
    + n - 1 of `rows` sorted rows, on the device (no host sync): a grid of the upper bound
    ceil(rows / block_m) + min(n, rows) tiles, the spare ones' expert -1."""
    block_m = 16 if rows <= 256 else 64
    counts = ends[first:first + n] - starts[first:first + n]
    tiles = (counts + block_m - 1) // block_m
    cum = tiles.cumsum(0)
    t = torch.arange(-(-rows // block_m) + min(n, rows), device=starts.device)
    e = torch.searchsorted(cum, t, right=True)
    inside = e < n
    e = e.clamp(max=n - 1)
    row = starts[first + e] + (t - (cum[e] - tiles[e])) * block_m
    return block_m, torch.where(inside, e, -1), row, ends[first + e]


def fused_linear(xs: torch.Tensor, w: QuantizedStack, first: int, starts: torch.Tensor, ends: torch.Tensor,
                 out: torch.Tensor | None = None, tiles: Tiles | None = None, glu: bool = False) -> torch.Tensor:
    """Rows of xs [P, K], sorted by expert (expert e's rows starts[e] .. ends[e]), through their expert's
    matrix w[e - first] -> out [P, N] in xs' dtype; only the rows of this stack's experts are written.
    glu: w is a gate_up [2f, K] and out [P, f] gets silu(gate) * up (models/moe.swiglu), computed in the
    kernel's epilogue."""
    from moelight.models.dequant_gemm_kernel import kernel

    n, N, K = w.shape
    N = N // 2 if glu else N
    P = xs.shape[0]
    if out is None:
        out = xs.new_empty(P, N)
    if n == 0 or P == 0:
        return out
    block_m, tile_expert, tile_row, tile_end = tiles if tiles is not None else tile_map(starts, ends, first, n, P)
    xs, codes, scales = xs.contiguous(), w.codes.contiguous(), w.scales.contiguous()
    offsets = w.offsets.contiguous() if w.offsets is not None else scales
    lut = _lut(w.fmt, xs.device)
    grid = (tile_expert.numel(), -(-N // BLOCK_N))
    interpret = xs.device.type != "cuda"
    target = out
    if interpret:  # Triton's interpreter writes each argument's whole storage back (a slot's neighbours,
        # which the expert cache's copy thread may be filling): give it storages of its own
        xs, codes, scales, offsets, lut, out = (t.clone() for t in (xs, codes, scales, offsets, lut, out))
    kernel(interpret)[grid](
        xs, codes, scales, offsets, lut, out, tile_expert, tile_row, tile_end,
        N, K, w.group, xs.stride(0), out.stride(0), codes.stride(0), codes.stride(1), scales.stride(0),
        scales.stride(1), FMT=FORMAT_CODES[w.fmt], HAS_OFFSETS=w.offsets is not None,
        IEEE=xs.dtype == torch.float32, UPCAST=interpret, GLU=glu, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_W=2 * BLOCK_N if glu else BLOCK_N, BLOCK_K=block_k(K, w.group))
    if target is not out:
        target.copy_(out)
    return target


_luts: dict[tuple[str, str], torch.Tensor] = {}


def _lut(fmt: str, device: torch.device) -> torch.Tensor:
    """float32 value of every code of fp8 (256) or e2m1 (16), as code_values computes them."""
    key = (fmt, str(device))
    if key not in _luts:
        if fmt == "fp8":
            values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
        elif fmt == "mxfp4":
            values = torch.tensor(E2M1, dtype=torch.float32)
        else:
            values = torch.zeros(1)
        _luts[key] = values.to(device)
    return _luts[key]
