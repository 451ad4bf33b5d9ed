"""Dense bf16 linears on the expert kernel's GEMM (csrc/strip_linear.cpp): the weight [N, K] packed once into
strips of 32 output columns in pair layout (expert_pack's bf16 strips), multiplied in float32 with the
products exact and the sums rounded to bf16 once.

Why: on CPUs whose oneDNN packs no bf16 (AVX2; AVX-512 without BF16) the engine's other choice is a packed
float32 copy of every attention projection and the LM head (runtime/cpu_linear.py), twice the weight's bytes
held and read per step.
"""

from __future__ import annotations

import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import STRIP, Alloc, QuantMatrix, _strips, ceil_to, torch_alloc
from cpu_kernels.expert_strips import plain_rows

# the expert GEMM levels strip_linear runs on (one row at a time, no tile layout)
_STRIP_ISAS = ("avx2", "avx512")


def strip_linear_available() -> bool:
    """The C++ kernels run here on an ISA level whose expert GEMM strip_linear uses."""
    return dispatch._cpp_available() and torch.ops.moelight.kernel_isa() in _STRIP_ISAS


def strips_fit(in_features: int) -> bool:
    """A weight of this input width strip_linear can take: whole strips' depth (the rows are read K wide,
    unpadded)."""
    return in_features % STRIP == 0


def pack_linear_strips(weight: torch.Tensor, alloc: Alloc = torch_alloc) -> torch.Tensor:
    """bf16 [N, K] -> strips [ceil(N / 32), K * 32] (the columns past N zero), written once into `alloc`'s
    buffer by the C++ packer where the kernels load (no full-size temporary), else by the torch reference."""
    n, k = weight.shape
    n_pad = ceil_to(n, STRIP)
    if dispatch.packs_expert_by_expert():
        out = alloc((1, n_pad // STRIP, k * STRIP), torch.bfloat16)
        torch.ops.moelight.pack_code_strips(weight.contiguous()[None], plain_rows(n, n_pad), k, False, out)
    else:
        out = _strips(QuantMatrix("bf16", weight.contiguous()[None]), n_pad, alloc)[0]
    return out.view(n_pad // STRIP, k * STRIP)


def unpack_linear_strips(strips: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [N, K] that pack_linear_strips packed (tests, the torch fallback)."""
    s, k = strips.shape[0], strips.shape[1] // STRIP
    w = strips.view(s, k // 2, STRIP, 2).permute(0, 2, 1, 3).reshape(s * STRIP, k)
    return w[:n]


def strip_linear(x: torch.Tensor, strips: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """bf16 x [..., K] @ W^T (+ bias) -> bf16 [..., n]: float32 sums rounded once (what a float32 copy of W
    computes, in another order of the sums). Under set_isa("none") the op computes them through torch."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and dispatch._cpp_available():
        return torch.ops.moelight.strip_linear(x, strips, bias, n)
    w = unpack_linear_strips(strips, n).float()
    return torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)
