"""Decode attention next to wherever the KV buffer lives (CPU kernel or plain torch on a GPU)."""

from __future__ import annotations

import torch

from cpu_kernels import decode_attention


def device_decode_attention(
    q, k, v, offsets: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention where the KV buffer lives: the CPU kernel on CPU tensors (the
    emulated device, bit-identical to the plain engine), plain torch on a GPU."""
    if q.device.type == "cpu":
        return decode_attention(q, k, v, offsets, lengths, scale)
    B, Hq, d = q.shape
    group = Hq // k.shape[0]
    out = torch.empty_like(q)
    for b, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist(), strict=True)):
        qb = q[b].float().view(k.shape[0], group, d)
        p = torch.softmax(torch.matmul(qb, k[:, o : o + n].float().transpose(1, 2)) * scale, dim=-1)
        out[b] = torch.matmul(p, v[:, o : o + n].float()).reshape(Hq, d).to(q.dtype)
    return out
