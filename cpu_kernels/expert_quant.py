"""Round-to-nearest quantization of expert weights into the kernels' canonical form (`QuantMatrix`).

- int8: symmetric, one scale per output channel (row): q = round(w / s), s = max|w| / 127.
- int4: symmetric per group of `group` input channels: q = round(w / s) in [-8, 7], s = max|w| / 7,
  stored as the unsigned code q + 8 with the additive term -8 s (the kernels' uint4 format, which
  also carries GPTQ / AWQ zero points).
Attention, embeddings and the LM head are not quantized.
"""

from __future__ import annotations

import torch

from cpu_kernels.expert_pack import QuantMatrix

INT4_GROUPS = (32, 64, 128)


def quantize_int8(w: torch.Tensor) -> QuantMatrix:
    """[E, N, K] float -> int8 codes with a float32 scale per row (group = K)."""
    wf = w.float()
    s = wf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    q = torch.round(wf / s).clamp(-127, 127).to(torch.int8)
    return QuantMatrix("int8", q.contiguous(), s.contiguous(), None, w.shape[-1])


def quantize_int4(w: torch.Tensor, group: int = 128) -> QuantMatrix:
    """[E, N, K] float -> 4-bit codes (two a byte along K) with a scale per row and group of K."""
    e, n, k = w.shape
    if group not in INT4_GROUPS or k % group:
        raise ValueError(f"int4 group size {group}: must be one of {INT4_GROUPS} and divide K = {k}")
    wf = w.float().view(e, n, k // group, group)
    s = wf.abs().amax(dim=-1).clamp(min=1e-12) / 7.0
    q = torch.round(wf / s.unsqueeze(-1)).clamp(-8, 7).to(torch.int16) + 8
    codes = q.view(e, n, k).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantMatrix("uint4", packed.contiguous(), s.contiguous(), (-8.0 * s).contiguous(), group)


def random_mxfp4(e: int, n: int, k: int, generator: torch.Generator | None = None) -> QuantMatrix:
    """[E, N, K] MXFP4 as GPT-OSS ships it (e2m1 codes, two a byte along K, a power-of-two scale per 32 k)
    with random codes and scales near a 0.02-wide weight's: for the kernel probes and benchmarks, whose
    speed does not depend on the values (no rounding from float weights is offered: GPT-OSS comes so)."""
    codes = torch.randint(0, 256, (e, n, k // 2), generator=generator, dtype=torch.uint8)
    scales = torch.ldexp(torch.ones(e, n, k // 32), torch.randint(-9, -6, (e, n, k // 32), generator=generator))
    return QuantMatrix("mxfp4", codes, scales, None, 32)


def int4_group_for(*dims: int, preferred: int = 128) -> int:
    """The largest int4 group size <= `preferred` that divides every K of a layer's experts."""
    for g in sorted(INT4_GROUPS, reverse=True):
        if g <= preferred and all(d % g == 0 for d in dims):
            return g
    raise ValueError(f"no int4 group size in {INT4_GROUPS} divides the expert widths {dims}")


def quantize(w: torch.Tensor, method: str, group: int = 128) -> QuantMatrix:
    """'int8' or 'int4' (group size for int4)."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group)
    raise ValueError(f"unknown quantization {method!r}: int8 or int4")
