"""Pure-torch attention: the fallback path and the tests' reference semantics."""

from __future__ import annotations

import torch


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, d]; k_cache/v_cache [Hkv, T, d]; offsets/lengths int64 [B] -> [B, Hq, d].

    One sequence at a time (slow, simple: the fallback and the semantics the C++ kernel
    must match). Accumulates in float32.
    """
    B, Hq, d = q.shape
    Hkv = k_cache.shape[0]
    group = Hq // Hkv
    out = torch.empty(B, Hq, d, dtype=q.dtype)
    offs = offsets.tolist()
    lens = lengths.tolist()
    for b in range(B):
        o, n = offs[b], lens[b]
        k = k_cache[:, o : o + n].float()  # [Hkv, n, d]
        v = v_cache[:, o : o + n].float()
        qb = q[b].float().view(Hkv, group, d)  # [Hkv, g, d]
        s = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hkv, g, n]
        p = torch.softmax(s, dim=-1)
        out[b] = torch.matmul(p, v).reshape(Hq, d).to(q.dtype)
    return out


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention over packed prompts: q [T, Hq, d], k/v [T, Hkv, d] -> [T, Hq, d]."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e == s:
            continue
        qs = q[s:e].transpose(0, 1)  # [Hq, n, d]
        ks = k[s:e].transpose(0, 1)
        vs = v[s:e].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True, scale=scale,
            enable_gqa=Hq != Hkv,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out
