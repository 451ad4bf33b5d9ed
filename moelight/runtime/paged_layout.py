"""Where a batch's keys live in a paged KV cache: block-table rows and the page size.

The engine's cache is the same [Hkv, slots, d] tensor per layer in both layouts; with a
`PagedLayout` instead of ragged offsets, position p of row b is slot
``tables[b, p // page_size] * page_size + p % page_size`` (engine/block_manager.py decides the
pages; prefix sharing points several rows at the same ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    tables: torch.Tensor  # int64 [B, pages]
    page_size: int
    starts: torch.Tensor | None = None  # prefill: positions of each row already in the cache (int64 [B])

    def slots(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Cache slots of `positions` [N] of block-table rows `rows` [N]."""
        page = self.tables[rows, positions // self.page_size]
        return page * self.page_size + positions % self.page_size

    def cached(self, rows: int) -> torch.Tensor:
        """Positions already in the cache per row (zeros when none are)."""
        return self.starts if self.starts is not None else torch.zeros(rows, dtype=torch.int64)
