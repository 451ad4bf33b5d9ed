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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, d]; k_cache/v_cache [Hkv, T, d]; offsets/lengths int64 [B] -> [B, Hq, d].

    One sequence at a time (slow, simple: the fallback and the semantics the C++ kernel
    must match). Accumulates in float32. `sinks` [Hq]: a learned logit per query head that
    joins every softmax's denominator and contributes no value (GPT-OSS).
    """
    B, Hq, d = q.shape
    Hkv = k_cache.shape[0]
    group = Hq // Hkv
    out = torch.empty(B, Hq, d, dtype=q.dtype, device=q.device)
    offs = offsets.tolist()
    lens = lengths.tolist()
    for b in range(B):
        o, n = offs[b], lens[b]
        k = k_cache[:, o : o + n].float()  # [Hkv, n, d]
        v = v_cache[:, o : o + n].float()
        qb = q[b].float().view(Hkv, group, d)  # [Hkv, g, d]
        s = torch.matmul(qb, k.transpose(1, 2)) * scale  # [Hkv, g, n]
        p = _softmax_with_sinks(s, sinks, Hkv, group)
        out[b] = torch.matmul(p, v).reshape(Hq, d).to(q.dtype)
    return out


def _softmax_with_sinks(s: torch.Tensor, sinks: torch.Tensor | None, hkv: int, group: int) -> torch.Tensor:
    """Softmax over the last axis of scores [Hkv, g, ...]; a sink is one more logit per head, dropped after."""
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink = sinks.float().view(hkv, group, *([1] * (s.dim() - 2))).expand(*s.shape[:-1], 1)
    both = torch.cat([s, sink], dim=-1)
    return torch.softmax(both - both.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]


def prefill_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over packed prompts: q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, dv] -> [T, Hq, dv].

    `window`: each query sees itself and the window - 1 keys before it; `sinks` as in decode."""
    if window is not None or sinks is not None:
        return _prefill_masked(q, k, v, cu_seqlens, scale, window, sinks)
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    out = q.new_empty(T, Hq, v.shape[-1])
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


def _prefill_masked(q, k, v, cu_seqlens, scale, window, sinks) -> torch.Tensor:
    """Prefill with a sliding window and/or sinks: explicit scores, float32."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    group = Hq // Hkv
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        n = e - s
        if n == 0:
            continue
        qs = q[s:e].float().transpose(0, 1).reshape(Hkv, group, n, d)
        ks, vs = k[s:e].float().transpose(0, 1), v[s:e].float().transpose(0, 1)  # [Hkv, n, d]
        scores = torch.matmul(qs, ks.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, g, n, n]
        i = torch.arange(n, device=q.device)
        visible = i[None, :] <= i[:, None]
        if window is not None:
            visible &= i[None, :] > i[:, None] - window
        scores = scores.masked_fill(~visible, float("-inf"))
        p = _softmax_with_sinks(scores, sinks, Hkv, group)
        o = torch.matmul(p, vs.unsqueeze(1))  # [Hkv, g, n, d]
        out[s:e] = o.reshape(Hq, n, d).transpose(0, 1).to(q.dtype)
    return out
