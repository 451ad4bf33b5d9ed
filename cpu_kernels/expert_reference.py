"""Pure-torch fused experts: the fallback where the C++ kernels cannot build, with the kernel's
semantics (float32 accumulation, the activation rounded to bf16 before the down projection, each
pair scaled by its routing weight and summed in float32, the sum rounded once)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels.expert_pack import NIBBLE_FORMATS, STRIP, PackedExperts, QuantMatrix, dequantize


@dataclass(frozen=True)
class ActSpec:
    """SwiGLU (kind 0) or GPT-OSS's clamped SwiGLU (kind 1: gate <= limit, |up| <= limit,
    (up + 1) * gate * sigmoid(alpha * gate))."""

    kind: int = 0
    limit: float = 0.0
    alpha: float = 1.702


def apply_act(gate: torch.Tensor, up: torch.Tensor, act: ActSpec) -> torch.Tensor:
    if act.kind == 1:
        gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit) + 1
        return up * gate * torch.sigmoid(act.alpha * gate)
    return torch.nn.functional.silu(gate) * up


def quantize_activation_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the fused kernel's int8-activation path sees it: each block of
    32 values rounded to int8 codes times amax / 127 (symmetric, ties to even), returned as the float64
    values q * scale. That path (csrc/expert_mix.cpp's RowQuant, iqgemm) serves int8 / int4 experts
    with up to 16 rows on AVX2."""
    xf = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def _unstrip(codes: torch.Tensor, scales, bias, fmt: str, group: int) -> torch.Tensor:
    """One expert's strips [S, bytes] -> float32 [S * 32, K] (w = value * scale + bias)."""
    s = codes.shape[0]
    if fmt in NIBBLE_FORMATS:
        rows = codes.view(s, -1, STRIP)
        rows = torch.cat((rows & 0x0F, rows >> 4), dim=-1)  # [S, K/2, 64] of 4-bit codes
        k = rows.shape[1] * 2
        natural = rows.view(s, k // 2, STRIP, 2).permute(0, 2, 1, 3).reshape(s * STRIP, k // 2, 2)
        natural = natural[..., 0] | (natural[..., 1] << 4)  # back to two codes a byte along K
    else:
        pair_rows = codes.shape[1] // (2 * STRIP)
        natural = codes.view(s, pair_rows, STRIP, 2).permute(0, 2, 1, 3).reshape(s * STRIP, 2 * pair_rows)
    if fmt == "bf16":
        return natural.float()
    def per_row(t):  # [S, groups, 32] -> [1, S * 32, groups]
        return None if t is None else t.permute(0, 2, 1).reshape(1, s * STRIP, -1)

    return dequantize(QuantMatrix(fmt, natural.unsqueeze(0), per_row(scales), per_row(bias), group))[0]


def unpack_expert(p: PackedExperts, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's float32 gate_up [2f, h] (gate rows, then up rows) and down [h, f], as the kernel sees them."""
    def pick(t):
        return None if t is None else t[e]

    w13 = _unstrip(p.w13[e], pick(p.s13), pick(p.z13), p.fmt13, p.group13)
    f, h = p.intermediate, p.hidden
    strips = w13.view(-1, 2, 16, w13.shape[-1])  # per strip: 16 gate rows, then 16 up rows
    gate, up = strips[:, 0].reshape(-1, w13.shape[-1]), strips[:, 1].reshape(-1, w13.shape[-1])
    w2 = _unstrip(p.w2[e], pick(p.s2), pick(p.z2), p.fmt2, p.group2)
    return torch.cat((gate[:f, :h], up[:f, :h])), w2[:h, :f]


def expert_biases(p: PackedExperts, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Expert e's gate_up bias [2f] (gate, then up) and down bias [h], or None."""
    b13 = None
    if p.bias13 is not None:
        strips = p.bias13[e].view(-1, 2, 16)
        b13 = torch.cat((strips[:, 0].reshape(-1)[: p.intermediate], strips[:, 1].reshape(-1)[: p.intermediate]))
    return b13, None if p.bias2 is None else p.bias2[e, : p.hidden]


def expert_mix_torch(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: PackedExperts,
                     act: ActSpec) -> torch.Tensor:
    """x [T, h], expert ids and routing weights [T, k] -> [T, h] in x's dtype (the fallback path)."""
    xf = x.to(torch.bfloat16).float()
    out = torch.zeros(x.shape[0], p.hidden, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13, w2 = unpack_expert(p, e)
        b13, b2 = expert_biases(p, e)
        g = xf[tok] @ w13.to(torch.bfloat16).float().T
        if b13 is not None:
            g = g + b13
        a = apply_act(g[:, : p.intermediate], g[:, p.intermediate :], act).to(torch.bfloat16).float()
        y = a @ w2.to(torch.bfloat16).float().T
        if b2 is not None:
            y = y + b2
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.to(x.dtype)
