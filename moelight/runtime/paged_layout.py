"""Where a batch's keys live in a paged KV cache: block-table rows and the page size.

The engine's cache is the same [Hkv, slots, d] tensor per layer in both layouts; with a
`PagedLayout` instead of ragged offsets, position p of row b is slot
``tables[b, p // page_size] * page_size + p % page_size`` (engine/block_manager.py decides the
pages; prefix sharing points several rows at the same ones).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

PAGE_SIZE = 16


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def reserved_rooms(rooms: list[int], paged: bool, page_size: int = PAGE_SIZE) -> list[int]:
    """Token slots each sequence reserves when it is admitted, largest first: its room (prompt + max new tokens),
    in whole pages where the cache is paged (engine/scheduler.py)."""
    return sorted((pages_for(n, page_size) * page_size if paged else n for n in rooms), reverse=True)


def pool_slots(rooms: list[int], batch: int, paged: bool, page_size: int = PAGE_SIZE) -> int:
    """Token slots of the KV pool a run of at most `batch` sequences at once allocates: the rooms of its `batch`
    largest, any of which may run together. Prefix sharing does not shrink it (sharing only leaves pages
    free), and the planner and the memory check count the same pool (planning/job_plan.workload_of)."""
    return sum(reserved_rooms(rooms, paged, page_size)[:max(1, batch)])


def block_hashes(prompt: list[int], page_size: int = PAGE_SIZE) -> list[bytes]:
    """Chained hashes of the prompt's full pages: hash i names tokens [0, (i + 1) * page_size)."""
    out, parent = [], b""
    for i in range(len(prompt) // page_size):
        block = prompt[i * page_size:(i + 1) * page_size]
        parent = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        out.append(parent)
    return out


def shared_prefix_tokens(prompts: list[list[int]], share: list[bool], page_size: int = PAGE_SIZE) -> list[int]:
    """Prompt positions of each prompt that prefix sharing serves from an earlier prompt's pages, if all
    were admitted together (what engine/block_manager.py reuses at best): a repeated prompt all of them,
    else its leading full pages an earlier prompt also begins with, never its last position."""
    seen_pages: set[bytes] = set()
    seen_prompts: set[tuple[int, ...]] = set()
    out = []
    for prompt, ok in zip(prompts, share, strict=True):
        hashes = block_hashes(prompt, page_size)
        reused = 0
        if ok and tuple(prompt) in seen_prompts:
            reused = len(prompt)
        elif ok:
            for h in hashes[: (len(prompt) - 1) // page_size]:
                if h not in seen_pages:
                    break
                reused += page_size
        seen_pages.update(hashes)
        if ok:
            seen_prompts.add(tuple(prompt))
        out.append(reused)
    return out


def row_groups(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive rows [b0, b1) whose lengths sum to at most `budget` (a longer row goes alone): the
    groups a prefill over cached prefixes attends in, so the prefixes it holds at once stay bounded."""
    groups, start, total = [], 0, 0
    for b, n in enumerate(lengths):
        if b > start and total + n > budget:
            groups.append((start, b))
            start, total = b, 0
        total += n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


@dataclass(frozen=True)
class PagedLayout:
    tables: torch.Tensor  # int64 [B, pages]
    page_size: int
    starts: torch.Tensor | None = None  # prefill: positions of each row already in the cache (int64 [B])
    keys: torch.Tensor | None = None  # the rows' sequences: the id an executor keeps per-sequence state under

    def slots(self, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Cache slots of `positions` [N] of block-table rows `rows` [N]."""
        page = self.tables[rows, positions // self.page_size]
        return page * self.page_size + positions % self.page_size

    def cached(self, rows: int) -> torch.Tensor:
        """Positions already in the cache per row (zeros when none are)."""
        return self.starts if self.starts is not None else torch.zeros(rows, dtype=torch.int64)

    def slot_table(self, lengths: list[int], width: int) -> torch.Tensor:
        """int64 [B, width]: row b's slots of positions [0, lengths[b]), zeros after (attention's gather);
        one gather over the block tables, no loop over rows (decode builds one per step)."""
        pos = torch.arange(width)
        pages = (pos // self.page_size).clamp(max=self.tables.shape[1] - 1).expand(len(lengths), width)
        table = self.tables.gather(1, pages) * self.page_size + pos % self.page_size
        return table.masked_fill(pos >= torch.tensor(lengths, dtype=torch.int64)[:, None], 0)

    def row_slots(self, counts: list[int]) -> torch.Tensor:
        """Cache slots of positions [0, counts[b]) of every row b, row after row (a prefix to read)."""
        table = self.slot_table(counts, max(counts, default=0))
        return table[torch.arange(table.shape[1]) < torch.tensor(counts, dtype=torch.int64)[:, None]]
