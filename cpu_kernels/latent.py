"""Latent decode attention (DeepSeek's MLA, absorbed): every query head attends the same cached rows
[latent, RoPE key]; a row's first `latent_dim` columns are also its value. An MQA whose key is the
whole row and whose value is its latent part, so each row is read once for all heads.

``latent_decode_attention(q, cache, offsets, lengths, scale, latent_dim)``: q [B, H, W] (absorbed
queries), cache [1, T, W] (one row per token slot; sequence b owns rows offsets[b] onwards, the first
lengths[b] valid) -> [B, H, latent_dim] in q's dtype. ``paged_latent_decode_attention(q, cache,
block_table, lengths, page_size, scale, latent_dim)``: the same over a paged cache (prefix sharing),
position p of sequence b at row ``block_table[b, p // page_size] * page_size + p % page_size``.

The C++ kernel (csrc/latent_attention.cpp) runs where it builds, the CPU has AVX-512 or AVX2 and
(W, latent_dim) is one it was compiled for: AMX tiles for a bf16 cache and bf16 queries where the CPU
has AMX-BF16 (csrc/latent_amx.cpp), AVX-512 / AVX2 otherwise; the torch reference below elsewhere
(and on a GPU).
"""

from __future__ import annotations

import torch

from cpu_kernels.dispatch import _cpp_available

# (row width, latent width) pairs the C++ kernel is instantiated for: every released DeepSeek-V2/V3,
# Kimi-K2 and Moonlight checkpoint (512 + 64, bench-deepseek too), and a small shape for tests
LATENT_SHAPES = ((576, 512), (96, 64))
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def latent_decode_attention(q: torch.Tensor, cache: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                            scale: float, latent_dim: int) -> torch.Tensor:
    if _cpp_ok(q, cache, latent_dim):
        return torch.ops.moelight.latent_decode_attention(q, cache, offsets, lengths, float(scale), latent_dim)
    return latent_decode_attention_torch(q, cache, offsets, lengths, scale, latent_dim)


def _cpp_ok(q: torch.Tensor, cache: torch.Tensor, latent_dim: int) -> bool:
    return (q.device.type == "cpu" and cache.device.type == "cpu" and cache.dtype in _DTYPES
            and (cache.shape[-1], latent_dim) in LATENT_SHAPES and cache.stride(-1) == 1 and _cpp_available())


def paged_latent_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                                  lengths: torch.Tensor, page_size: int, scale: float, latent_dim: int) -> torch.Tensor:
    if _cpp_ok(q, cache, latent_dim):
        return torch.ops.moelight.paged_latent_decode_attention(q, cache, block_table, lengths, int(page_size),
                                                                float(scale), latent_dim)
    # the reference over each sequence's rows gathered into a ragged copy
    lens = lengths.to(torch.int64).cpu()
    pos = torch.cat([torch.arange(int(n)) for n in lens]) if len(lens) else torch.zeros(0, dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(lens)), lens).to(block_table.device)
    pos = pos.to(block_table.device)
    slots = block_table[rows, pos // page_size] * page_size + pos % page_size
    gathered = cache.index_select(1, slots)
    offsets = (torch.cumsum(lens, 0) - lens).to(q.device)
    return latent_decode_attention_torch(q, gathered, offsets, lens, scale, latent_dim)


def latent_decode_attention_torch(q: torch.Tensor, cache: torch.Tensor, offsets: torch.Tensor,
                                  lengths: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    """One sequence at a time in float32 (the fallback and the semantics the C++ kernel matches)."""
    B, H, W = q.shape
    if cache.dim() != 3 or cache.shape[0] != 1 or cache.shape[-1] != W or not 0 < latent_dim <= W:
        raise ValueError(f"latent attention: q {tuple(q.shape)}, cache {tuple(cache.shape)} and latent_dim "
                         f"{latent_dim} do not fit (q [B, H, W], cache [1, T, W], latent_dim <= W)")
    out = q.new_empty(B, H, latent_dim)
    for b, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist(), strict=True)):
        rows = cache[0, o : o + n].float()  # [n, W]
        p = torch.softmax(torch.matmul(q[b].float(), rows.T) * scale, dim=-1)  # [H, n]
        out[b] = torch.matmul(p, rows[:, :latent_dim]).to(q.dtype)
    return out
