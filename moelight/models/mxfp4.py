"""MXFP4 (OCP microscaling FP4) expert weights, as GPT-OSS checkpoints ship them: kept packed where
the fused CPU kernel runs them (`mxfp4_piece`), dequantised at load into the run's dtype elsewhere.
Each block of 32 values is 16 bytes of e2m1 nibbles (low nibble first) and one shared power-of-two
scale byte (E8M0, bias 127)."""

from __future__ import annotations

import torch

from moelight.models.quantized_experts import QuantPiece

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] (exact in bf16 and f32)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., G, 16], scales [..., G])")
    b = blocks.to(torch.uint8)
    values = _BYTE_PAIRS[b.long()].reshape(*b.shape[:-1], 32)  # one gather: a byte -> its two values
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.reshape(*b.shape[:-2], -1).to(dtype)


def _byte_pairs() -> torch.Tensor:
    """[256, 2]: the (low nibble, high nibble) values of every byte."""
    lut, byte = torch.tensor(E2M1, dtype=torch.float32), torch.arange(256)
    return torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)


_BYTE_PAIRS = _byte_pairs()


def mxfp4_piece(blocks: torch.Tensor, scales: torch.Tensor) -> QuantPiece:
    """The same tensors kept packed for the fused kernel: codes [..., G * 16] (two e2m1 values a byte,
    low nibble first, as shipped) and float32 scales [..., G] (2^(e - 127)), one per 32 values."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         "(blocks [..., G, 16], scales [..., G])")
    codes = blocks.to(torch.uint8).reshape(*blocks.shape[:-2], -1)
    return QuantPiece("mxfp4", codes, torch.exp2(scales.to(torch.float32) - 127.0))
