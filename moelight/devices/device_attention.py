"""Decode attention next to wherever the KV buffer lives (CPU kernel or plain torch on a GPU)."""

from __future__ import annotations

import torch

from cpu_kernels import decode_attention
from cpu_kernels.reference import decode_attention_torch


def device_decode_attention(
    q, k, v, offsets: torch.Tensor, lengths: torch.Tensor, scale: float, window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention where the KV buffer lives: the CPU kernel on CPU tensors (the
    emulated device, bit-identical to the plain engine), plain torch on a GPU. A sliding
    window narrows each sequence's block; sinks join each softmax's denominator."""
    if q.device.type == "cpu":
        return decode_attention(q, k, v, offsets, lengths, scale, window=window, sinks=sinks)
    if window is not None:
        skip = (lengths - window).clamp(min=0)
        offsets, lengths = offsets + skip, lengths - skip
    return decode_attention_torch(q, k, v, offsets, lengths, scale, sinks)
