"""Latent KV cache for multi-head latent attention (DeepSeek): per layer one [1, T_total, W] tensor
of rows [latent (kv_lora_rank), RoPE key (qk_rope_head_dim)], no per-head K or V.

A token costs W elements per layer ((512 + 64) x 2 B = 1,152 B in bf16 for DeepSeek-V2/V3) where
Mixtral's GQA costs 2 x 8 x 128 x 2 B = 4,096 B, so host memory holds ~3.5x the tokens. The layout is
RaggedKVCache's with one KV head: a sequence owns `capacity` consecutive rows, so each sequence is one
contiguous block for the latent attention kernel (cpu_kernels.latent_decode_attention), and the code
that moves, writes and attends a cache treats both alike (`layer`, `write`, `attend`, `prefix_attend`,
`copy_pages`, `like`). Paged (prefix sharing), decode reads the rows through the block tables; a prompt
after a cached prefix expands the prefix's rows to per-head K and V as its own (`prefix_attend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cpu_kernels import latent_decode_attention, paged_latent_decode_attention, paged_prefill_attention
from moelight.models.config import ModelConfig
from moelight.runtime.host_memory import empty_huge
from moelight.runtime.kv_cache import RaggedKVCache, copy_cache_pages
from moelight.runtime.paged_layout import PagedLayout, row_groups

Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # cache rows [T, 1, W] -> K, V [T, H, d]
EXPAND_BUDGET = 256 << 20  # bytes of expanded prefix K and V that prefix_attend holds at once


@dataclass
class LatentKVCache:
    supports_paged = True  # a block table may place its rows (prefix sharing)
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

    def attend(self, j: int, q: torch.Tensor, place: torch.Tensor | PagedLayout, lengths: torch.Tensor, scale: float,
               **extras) -> torch.Tensor:
        """Absorbed queries q [B, H, W] over layer j's rows -> [B, H, latent_dim]; `place`: each sequence's
        first row [B], or its block-table row (a paged cache)."""
        if extras:
            raise ValueError(f"latent attention takes no sliding window or sinks (got {sorted(extras)})")
        if isinstance(place, PagedLayout):
            return paged_latent_decode_attention(q, self.kv[j], place.tables, lengths, place.page_size, scale,
                                                 self.latent_dim)
        return latent_decode_attention(q, self.kv[j], place, lengths, scale, self.latent_dim)

    def prefix_attend(self, j: int, q: torch.Tensor, expand: Expand, place: PagedLayout, seq_lens: torch.Tensor,
                      cu: torch.Tensor, scale: float, upload: Callable | None = None, **extras) -> torch.Tensor:
        """Prefill of new tokens q [T, H, d] (packed by `cu`, their rows written already) after each row's
        cached prefix (`place.starts`): every position's row, prefix and new, expanded by `expand` (the
        layer's prefill_kv), then causal attention from the prefix's end -> [T, H, v]. The prefix costs its
        expansion (kv_b_proj over its rows), not its projections and experts. Rows go in groups whose
        expanded K and V stay within EXPAND_BUDGET bytes (a chunk of short new tokens may sit on long
        prefixes). `upload` moves host index tensors to q's device."""
        if extras:
            raise ValueError(f"latent attention takes no sliding window or sinks (got {sorted(extras)})")
        up = upload or (lambda t: t.to(q.device))
        cached = place.cached(len(seq_lens))
        lengths = (cached + seq_lens).tolist()
        per_row = 4 * q.shape[1] * q.shape[2] * q.element_size()  # K, V padded to K's width, their copies
        outs = []
        for b0, b1 in row_groups(lengths, max(EXPAND_BUDGET // per_row, 1)):
            group = PagedLayout(place.tables[b0:b1], place.page_size)
            qs = q[int(cu[b0]):int(cu[b1])]
            outs.append(self._expanded_attention(j, qs, expand, group, lengths[b0:b1], cached[b0:b1],
                                                 cu[b0:b1 + 1] - cu[b0], scale, up))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _expanded_attention(self, j: int, q: torch.Tensor, expand: Expand, place: PagedLayout, lengths: list[int],
                            cached: torch.Tensor, cu: torch.Tensor, scale: float, up: Callable) -> torch.Tensor:
        """prefix_attend over one group of rows, each row's positions [0, lengths[b]) expanded, row after row."""
        rows = self.kv[j].index_select(1, up(place.row_slots(lengths)))  # [1, S, W]
        k, v = expand(rows.transpose(0, 1))
        n = torch.tensor(lengths, dtype=torch.int64)
        table = ((torch.cumsum(n, 0) - n)[:, None] + torch.arange(max(lengths, default=0))).clamp(
            max=max(sum(lengths) - 1, 0))  # position p of row b: its expanded row, one slot a "page"
        return paged_prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), up(table), cached, cu, 1, scale)

    def copy_pages(self, copies: list[tuple[int, int]], page_size: int) -> None:
        """Copy-on-write of whole pages (source, destination) in every layer (engine/block_manager.py)."""
        copy_cache_pages(self.kv, copies, page_size)

    def like(self, layers: list[tuple[torch.Tensor, ...]], offsets: torch.Tensor | None = None) -> LatentKVCache:
        """A cache of this layout over other tensors (device copies, packed buffers), one tuple per layer."""
        offs = self.offsets if offsets is None else offsets
        return LatentKVCache([t for (t,) in layers], offs, self.capacity, self.latent_dim)


def kv_cache_class(cfg: ModelConfig) -> type:
    """The cache layout a model's attention reads: latent rows for MLA, per-head K and V otherwise."""
    return LatentKVCache if cfg.mla is not None else RaggedKVCache
