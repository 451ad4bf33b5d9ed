"""Attention on the device, next to a KV buffer there: batched over the sequences of a micro-batch
with every index on the device, so it issues a fixed number of kernels and no host sync.

Decode: each sequence's keys are gathered into [Hkv, B, max_len, d] (max_len known on the host:
positions are host data), scored against its query heads, masked past its length, softmaxed in
float32 (with GPT-OSS's sinks in the denominator), and the values weighted; a sliding window
narrows each sequence's block first. Prefill: per prompt, with the packed prompts' bounds given
on the host (the kernels of cpu_kernels on CPU tensors, the torch reference on a GPU).
"""

from __future__ import annotations

import torch

from cpu_kernels import prefill_attention


def batched_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, offsets: torch.Tensor,
                             lengths: torch.Tensor, max_len: int, scale: float, window: int | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, d] over the ragged cache: keys [Hkv, T, d], values [Hkv, T, dv] (MLA's latent: the
    keys' first dv columns; offsets / lengths [B] on q's device, max_len >= every length, a host
    int) -> [B, Hq, dv] in q's dtype."""
    B, Hq, d = q.shape
    dv = v_cache.shape[-1]
    Hkv = k_cache.shape[0]
    g = Hq // Hkv
    if window is not None:
        skip = (lengths - window).clamp(min=0)
        offsets, lengths = offsets + skip, lengths - skip
        max_len = min(max_len, window)
    span = torch.arange(max_len, device=q.device)
    valid = span[None, :] < lengths[:, None]  # [B, M]
    idx = torch.where(valid, offsets[:, None] + span[None, :], 0).reshape(-1)
    k = k_cache.index_select(1, idx).view(Hkv, B, max_len, d).float()
    v = v_cache.index_select(1, idx).view(Hkv, B, max_len, dv).float()
    qh = q.float().view(B, Hkv, g, d).transpose(0, 1)  # [Hkv, B, g, d]
    s = torch.matmul(qh, k.transpose(-1, -2)) * scale  # [Hkv, B, g, M]
    s = s.masked_fill(~valid[None, :, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(Hkv, 1, g, 1).expand(Hkv, B, g, 1)
        both = torch.cat([s, sink], dim=-1)
        p = torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v)  # [Hkv, B, g, dv]
    return out.transpose(0, 1).reshape(B, Hq, dv).to(q.dtype)


def device_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_host: torch.Tensor, scale: float,
                             window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over packed prompts on the device: the prompts' bounds `cu_host` stay a host
    tensor, so splitting the batch reads nothing back from the device."""
    assert cu_host.device.type == "cpu", "prompt bounds must be host data"
    return prefill_attention(q, k, v, cu_host, scale, window=window, sinks=sinks)
