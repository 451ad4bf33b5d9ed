"""FP8 (e4m3) weights with block scales, as DeepSeek-V3 / R1 and Kimi-K2 ship them: dequantised at
load into the run's dtype, or, for routed experts in a bfloat16 CPU run, kept in e4m3 (`fp8_piece`).
Each `[block_out, block_in]` tile of a weight shares one float32 scale, stored beside it as
`<name>_scale_inv` (`[ceil(out / block_out), ceil(in / block_in)]`); the value is the e4m3 number
times its tile's scale (DeepSeek's `weight_dequant`)."""

from __future__ import annotations

import torch

from moelight.models.quantized_experts import QuantPiece

FP8_DTYPES = (torch.float8_e4m3fn,)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """weight [out, in] (float8_e4m3fn) and its tile scales -> float32 [out, in]."""
    if weight.dim() != 2 or len(block) != 2:
        raise ValueError(f"an FP8 weight of shape {tuple(weight.shape)} with block {list(block)}: expected a "
                         "2-D weight and a [rows, columns] block")
    (out, inp), (bo, bi) = weight.shape, block
    tiles = (-(-out // bo), -(-inp // bi))
    if tuple(scale_inv.shape) != tiles:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, a weight of shape {(out, inp)} in "
                         f"{bo}x{bi} blocks needs {tiles}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * scale


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools that write FP8 checkpoints: (e4m3 weight, scale_inv) with each
    tile's largest magnitude mapped to e4m3's largest finite value (448)."""
    out, inp = weight.shape
    bo, bi = block
    tiles = (-(-out // bo), -(-inp // bi))
    padded = torch.zeros(tiles[0] * bo, tiles[1] * bi, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    amax = padded.view(tiles[0], bo, tiles[1], bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    scale = scale_inv.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale_inv


def fp8_piece(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, ...]) -> QuantPiece:
    """The same weight kept in e4m3 for the fused kernel: codes [out, in] and a float32 scale per row and
    `block[1]` columns (each tile's scale repeated down its rows)."""
    (out, inp), (bo, bi) = weight.shape, block
    if inp % bi or tuple(scale_inv.shape) != (-(-out // bo), inp // bi):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, a weight of shape {(out, inp)} in "
                         f"{bo}x{bi} blocks needs {(-(-out // bo), inp // bi)}")
    scales = scale_inv.float().repeat_interleave(bo, 0)[:out]
    return QuantPiece("fp8", weight.view(torch.uint8), scales.contiguous())
