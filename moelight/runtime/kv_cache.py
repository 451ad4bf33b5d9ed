"""Ragged KV cache in CPU memory: one [H_kv, T_total, d] tensor per layer for K and for V.

Each sequence owns `capacity` consecutive token slots (prompt + max new tokens), so no
slot is wasted on padding to the longest sequence and each (sequence, head) block is
contiguous for the attention kernel (see cpu_kernels/__init__.py). The tensors sit on
2 MiB huge pages where the OS offers them (moelight.runtime.host_memory): attention streams them
every decode step, and 4 KiB pages cost it a TLB miss and a prefetcher restart every 4 KiB.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels import decode_attention, dispatch, paged_decode_attention, paged_prefill_attention
from moelight.models.config import ModelConfig
from moelight.runtime.host_memory import empty_huge
from moelight.runtime.paged_layout import PagedLayout


@dataclass
class RaggedKVCache:
    supports_paged = True  # a block table may place its slots (prefix sharing): copy_pages, attend(PagedLayout)
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    offsets: torch.Tensor  # int64 [S]: first slot of each sequence
    capacity: torch.Tensor  # int64 [S]

    @classmethod
    def allocate(cls, cfg: ModelConfig, capacities: list[int], dtype: torch.dtype) -> RaggedKVCache:
        caps = torch.tensor(capacities, dtype=torch.int64)
        offsets = torch.cumsum(caps, 0) - caps
        total = int(caps.sum())
        shape = (cfg.num_kv_heads, total, cfg.head_dim)
        k = [empty_huge(shape, dtype) for _ in range(cfg.num_layers)]
        v = [empty_huge(shape, dtype) for _ in range(cfg.num_layers)]
        return cls(k, v, offsets, caps)

    @classmethod
    def pool(cls, cfg: ModelConfig, total_tokens: int, dtype: torch.dtype) -> RaggedKVCache:
        """Cache of `total_tokens` slots whose regions the caller assigns (moelight.engine.slot_pool)."""
        shape = (cfg.num_kv_heads, total_tokens, cfg.head_dim)
        k = [empty_huge(shape, dtype) for _ in range(cfg.num_layers)]
        v = [empty_huge(shape, dtype) for _ in range(cfg.num_layers)]
        empty = torch.zeros(0, dtype=torch.int64)
        return cls(k, v, empty, empty)

    @staticmethod
    def bytes_needed(cfg: ModelConfig, total_tokens: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * total_tokens * elem

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k/v [T, H_kv, d] of T tokens at absolute cache slots [T] (on the CPU one call of cpu_kernels)."""
        if dispatch.kv_write(self.k[layer], self.v[layer], k, v, slots):
            return
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def copy_pages(self, copies: list[tuple[int, int]], page_size: int) -> None:
        """Copy whole pages (source, destination) of every layer: a paged sequence's own copy of a page
        it shared (copy-on-write, engine/block_manager.py)."""
        copy_cache_pages([*self.k, *self.v], copies, page_size)

    def layer(self, j: int) -> tuple[torch.Tensor, ...]:
        """Layer j's tensors, in the order a cache entry lists them (K, V)."""
        return self.k[j], self.v[j]

    def key_value(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values attention reads in layer j."""
        return self.k[j], self.v[j]

    def attend(self, j: int, q: torch.Tensor, place: torch.Tensor | PagedLayout, lengths: torch.Tensor, scale: float,
               **extras) -> torch.Tensor:
        """Decode attention of q [B, Hq, d] over layer j (extras: a sliding window, sinks) -> [B, Hq, d];
        `place`: each sequence's first slot [B], or its block-table row (a paged cache)."""
        if isinstance(place, PagedLayout):
            return paged_decode_attention(q, self.k[j], self.v[j], place.tables, lengths, place.page_size, scale,
                                          **extras)
        return decode_attention(q, self.k[j], self.v[j], place, lengths, scale, **extras)

    def prefix_attend(self, j: int, q: torch.Tensor, expand, place: PagedLayout, seq_lens: torch.Tensor,
                      cu: torch.Tensor, scale: float, **extras) -> torch.Tensor:
        """Prefill of new tokens q [T, Hq, d] (packed by `cu`, their K/V written already) after each row's
        cached prefix (`place.starts`), read through the block tables -> [T, Hq, d]. `expand` (how an MLA
        cache turns rows into K and V) is not needed here: the pages hold K and V."""
        return paged_prefill_attention(q, self.k[j], self.v[j], place.tables, place.cached(len(seq_lens)), cu,
                                       place.page_size, scale, **extras)

    def like(self, layers: list[tuple[torch.Tensor, ...]], offsets: torch.Tensor | None = None) -> RaggedKVCache:
        """A cache of this layout over other tensors (device copies, packed buffers), one (k, v) per layer."""
        offs = self.offsets if offsets is None else offsets
        return RaggedKVCache([k for k, _ in layers], [v for _, v in layers], offs, self.capacity)


def copy_cache_pages(tensors: list[torch.Tensor], copies: list[tuple[int, int]], page_size: int) -> None:
    """Copy whole pages (source, destination) along the slot dimension (1) of every tensor of a cache."""
    dev = tensors[0].device  # a device's copy of the cache (latency mode) copies there
    src = torch.cat([torch.arange(a * page_size, (a + 1) * page_size, device=dev) for a, _ in copies])
    dst = torch.cat([torch.arange(b * page_size, (b + 1) * page_size, device=dev) for _, b in copies])
    for t in tensors:
        t.index_copy_(1, dst, t.index_select(1, src))
