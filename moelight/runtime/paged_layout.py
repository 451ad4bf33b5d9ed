"""Where a batch's keys live in a paged KV cache: block-table rows and the page size.

The engine's cache is the same [Hkv, slots, d] tensor per layer in both layouts; with a
`PagedLayout` instead of ragged offsets, position p of row b is slot
``tables[b, p // page_size] * page_size + p % page_size`` (engine/block_manager.py decides the
pages; prefix sharing points several rows at the same ones).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter
from dataclasses import dataclass

import torch

PAGE_SIZE = 16


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def reserved_rooms(rooms: list[int], paged: bool, page_size: int = PAGE_SIZE) -> list[int]:
    """Token slots each sequence reserves when it is admitted, largest first: its room (prompt + max new tokens),
    in whole pages where the cache is paged (engine/scheduler.py)."""
    return sorted((pages_for(n, page_size) * page_size if paged else n for n in rooms), reverse=True)


def pool_table(rooms: list[int], paged: bool, prompts: list[list[int]] | None = None,
               share: list[bool] | None = None, page_size: int = PAGE_SIZE) -> list[int]:
    """Token slots of the KV pool for a run of at most 1, 2, ... len(rooms) sequences at once (entry b - 1: batch b).

    Unpaged, or paged without `prompts`: the rooms of the b largest sequences, any of which may run together.
    Paged with the prompts (prefix sharing; `share[j]`: j may reuse others' pages): every page a prompt may reuse
    is counted once per distinct prefix live at once, the rest of each room per sequence -- the b largest private
    parts plus the pages of the b longest distinct prefixes (prefix_pages), or the unshared pool where that is
    less (b sequences of distinct prompts: each repeated prompt's last page is counted in its prefix and by each
    copy). That bounds what any b sequences engine/block_manager.py holds at once need, but for one transient
    where the unshared pool is the smaller: a twin whose owner ended holds the owner's partial page and its own
    copy until its first write, one page above its room, and admission may wait for that write. The first entry
    holds any one sequence's room, so admission, which waits for pages, can always admit into an empty pool."""
    unshared = list(itertools.accumulate(reserved_rooms(rooms, paged, page_size)))
    if not paged or prompts is None:
        return unshared
    share = share if share is not None else [True] * len(prompts)
    private, chains = prefix_pages(prompts, share, page_size)
    private = sorted((pages_for(n, page_size) - s for n, s in zip(rooms, private, strict=True)), reverse=True)
    shared = list(itertools.accumulate(chains)) or [0]
    return [min(u, (p + shared[min(b, len(shared) - 1)]) * page_size)
            for b, (u, p) in enumerate(zip(unshared, itertools.accumulate(private), strict=True))]


def pool_slots(rooms: list[int], batch: int, paged: bool, prompts: list[list[int]] | None = None,
               share: list[bool] | None = None, page_size: int = PAGE_SIZE) -> int:
    """Token slots of the KV pool a run of at most `batch` sequences at once allocates (pool_table's entry); the
    planner and the memory check count the same pool (planning/job_plan.kv_pool_table)."""
    if not rooms:
        return 0
    return pool_table(rooms, paged, prompts, share, page_size)[min(max(1, batch), len(rooms)) - 1]


def one_prefix_pool(prompt_len: float, room: float, shared_prefix: float,
                    page_size: int = PAGE_SIZE) -> tuple[int, int, int]:
    """The paged pool of a job given as figures whose prompts (`prompt_len` tokens, `room` with their new
    tokens) all begin with one prefix of `shared_prefix` tokens -> (slots a sequence reserves alone, slots each
    reserves beside the prefix, slots the prefix holds once for the whole batch): pool_table's pool for b such
    prompts is min(b x the first, b x the second + the third). A sequence reuses
    the prefix's whole pages, never the one holding its last prompt position; a prefix that is the whole prompt
    (the samples of one prompt) also holds that last page once, which each sequence still counts as its own."""
    prompt = math.ceil(prompt_len)
    reused = min(int(shared_prefix) // page_size, (prompt - 1) // page_size)
    once = pages_for(prompt, page_size) if shared_prefix >= prompt else reused
    alone = pages_for(math.ceil(room), page_size)
    return alone * page_size, (alone - reused) * page_size, once * page_size


def prefix_pages(prompts: list[list[int]], share: list[bool],
                 page_size: int = PAGE_SIZE) -> tuple[list[int], list[int]]:
    """How prefix sharing may split the prompts' pages -> (the leading pages each prompt may reuse, the page
    counts of the distinct shared prefixes, longest first).

    A prompt may reuse its leading full pages (never the one holding its last position) that another sharing
    prompt also has; a prompt that occurs more than once (the n samples of one prompt: twins) also shares its
    last page, which a twin holds after its owner finished, so that page is counted in the prefix while each
    copy still counts it as its own. The prefixes form a tree of pages; the most pages b of its root paths cover
    are the b longest paths of its long-path decomposition (the child with the deepest subtree continues its
    parent's path, every other child starts one)."""
    repeats = Counter(tuple(p) for p, ok in zip(prompts, share, strict=True) if ok)
    chains: list[list] = []
    for p, ok in zip(prompts, share, strict=True):
        chain: list = block_hashes(p, page_size)[: (len(p) - 1) // page_size] if ok else []
        if ok and repeats[tuple(p)] > 1:
            chain.append(tuple(p))  # its last page, full or partial
        chains.append(chain)
    holders = Counter(node for chain in chains for node in chain)
    height: dict = {}  # shared node -> pages on the longest shared path down from it, itself included
    parent: dict = {}
    reused = []
    for chain in chains:
        n = next((i for i, node in enumerate(chain) if holders[node] < 2), len(chain))
        for i in range(n):
            height[chain[i]] = max(height.get(chain[i], 0), n - i)
            parent[chain[i]] = chain[i - 1] if i else None
        reused.append(min(n, len(chain) - isinstance(chain[-1], tuple)) if chain else 0)
    heavy: dict = {}  # node -> its child with the deepest subtree
    for node, h in height.items():
        up = parent[node]
        if up is not None and (up not in heavy or h > height[heavy[up]]):
            heavy[up] = node
    heads = [node for node in height if parent[node] is None or heavy[parent[node]] != node]
    return reused, sorted((height[node] for node in heads), reverse=True)


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
