"""Latent KV cache for multi-head latent attention (DeepSeek): per layer one [1, T_total, W] tensor
of rows [latent (kv_lora_rank), RoPE key (qk_rope_head_dim)], no per-head K or V.

A token costs W elements per layer ((512 + 64) x 2 B = 1,152 B in bf16 for DeepSeek-V2/V3) where
Mixtral's GQA costs 2 x 8 x 128 x 2 B = 4,096 B, so host memory holds ~3.5x the tokens. The layout is
RaggedKVCache's with one KV head: a sequence owns `capacity` consecutive rows, so each sequence is one
contiguous block for the latent attention kernel (cpu_kernels.latent_decode_attention), and the code
that moves, writes and attends a cache treats both alike (`layer`, `write`, `attend`, `like`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels import latent_decode_attention
from moelight.models.config import ModelConfig
from moelight.runtime.host_memory import empty_huge


@dataclass
class LatentKVCache:
    supports_paged = False  # no paged latent kernel yet: prefix sharing stays off for MLA models
    kv: list[torch.Tensor]  # per layer [1, T_total, kv_lora_rank + qk_rope_head_dim]
    offsets: torch.Tensor  # int64 [S]: first slot of each sequence
    capacity: torch.Tensor  # int64 [S]
    latent_dim: int  # kv_lora_rank: the first columns of a row, what attention returns per head

    @classmethod
    def allocate(cls, cfg: ModelConfig, capacities: list[int], dtype: torch.dtype) -> LatentKVCache:
        caps = torch.tensor(capacities, dtype=torch.int64)
        cache = cls.pool(cfg, int(caps.sum()), dtype)
        cache.offsets, cache.capacity = torch.cumsum(caps, 0) - caps, caps
        return cache

    @classmethod
    def pool(cls, cfg: ModelConfig, total_tokens: int, dtype: torch.dtype) -> LatentKVCache:
        """Cache of `total_tokens` rows whose regions the caller assigns (moelight.engine.slot_pool)."""
        shape = (1, total_tokens, cfg.mla.cache_width)
        empty = torch.zeros(0, dtype=torch.int64)
        return cls([empty_huge(shape, dtype) for _ in range(cfg.num_layers)], empty, empty, cfg.mla.kv_lora_rank)

    @staticmethod
    def bytes_needed(cfg: ModelConfig, total_tokens: int, dtype: torch.dtype) -> int:
        return cfg.num_layers * cfg.mla.cache_width * total_tokens * dtype.itemsize

    def layer(self, j: int) -> tuple[torch.Tensor, ...]:
        """Layer j's tensors, in the order a cache entry lists them."""
        return (self.kv[j],)

    def key_value(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads in layer j as keys and values: the whole row, and its latent part."""
        return self.kv[j], self.kv[j][..., : self.latent_dim]

    def write(self, layer: int, row: torch.Tensor, slots: torch.Tensor) -> None:
        """Store rows [T, 1, W] of T tokens at absolute cache slots [T]."""
        self.kv[layer].index_copy_(1, slots, row.transpose(0, 1))

    def attend(self, j: int, q: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, scale: float,
               **extras) -> torch.Tensor:
        """Absorbed queries q [B, H, W] over layer j's rows -> [B, H, latent_dim]."""
        if extras:
            raise ValueError(f"latent attention takes no sliding window or sinks (got {sorted(extras)})")
        return latent_decode_attention(q, self.kv[j], offsets, lengths, scale, self.latent_dim)

    def like(self, layers: list[tuple[torch.Tensor, ...]], offsets: torch.Tensor | None = None) -> LatentKVCache:
        """A cache of this layout over other tensors (device copies, packed buffers), one tuple per layer."""
        offs = self.offsets if offsets is None else offsets
        return LatentKVCache([t for (t,) in layers], offs, self.capacity, self.latent_dim)


def kv_cache_class(cfg: ModelConfig) -> type:
    """The cache layout a model's attention reads: latent rows for MLA, per-head K and V otherwise."""
    from moelight.runtime.kv_cache import RaggedKVCache

    return LatentKVCache if cfg.mla is not None else RaggedKVCache
