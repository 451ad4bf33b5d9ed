"""Paged KV placement with prefix sharing: pages, reference counts, prefix hashes, copy-on-write.

The cache is the ragged pool's [Hkv, pages * PAGE_SIZE, d] tensor per layer, cut into pages of
PAGE_SIZE token slots; each sequence has a block table (its pages, in position order). Two ways
of sharing, both decided when a sequence is admitted:

- **Prefix blocks** (vLLM's automatic prefix caching): every full page of a prompt is named by a
  hash of its tokens chained with the hash of the page before it, so equal hashes mean equal
  prefixes. A prompt whose leading full pages are already named reuses them (reference count + 1)
  and computes only the rest; it never reuses its last prompt position (its logits are needed).
  A page named by a sequence that has not been prefilled yet is *pending*: whoever reuses it is
  prefilled in a later wave than its owner (`prefill_waves`). Pages of finished sequences keep
  their names until their room is needed (least recently freed first), so a later request with
  the same system prompt still finds them.
- **Twins** (the `n` samples of one prompt): a prompt equal to one admitted in the same round
  shares all its owner's prompt pages, the partial last one included, is not prefilled at all,
  and samples its first token from its owner's logits. The partial page is copied to a page
  reserved for the twin before the twin's first write into it (`copy_on_write`).

Every admitted sequence reserves every page it may fill (prompt + max new tokens), so a running
sequence never waits for a page; `admit` says False when the free (or evictable) pages do not
suffice, and the scheduler waits (the pool counts shared prefixes once: runtime/paged_layout.
pool_table). Fresh pages are taken as one consecutive run where the pool has one, so an unshared
sequence is one contiguous block for the attention kernels, as in the ragged cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from moelight.engine.slot_pool import SlotPool
from moelight.runtime.paged_layout import PAGE_SIZE, PagedLayout, block_hashes, pages_for

__all__ = ["PAGE_SIZE", "BlockManager", "block_hashes", "pages_for"]

@dataclass
class _Seq:
    pages: list[int]
    cached: int = 0  # prompt positions it does not compute (in shared pages)
    twin_of: int | None = None
    after: set[int] = field(default_factory=set)  # owners of pending pages it reads
    cow_page: int | None = None  # reserved for its copy of a shared partial page


class BlockManager:
    """Pages of one engine run; sequences are the run's local indices."""

    def __init__(self, prompts: list[list[int]], capacities: list[int], total_pages: int,
                 share: list[bool], page_size: int = PAGE_SIZE) -> None:
        """`capacities`: slots each sequence may fill; `share[j]`: j may reuse others' pages (a prompt
        asking for prompt_logprobs computes every position, so it reuses none; it still names its pages)."""
        self.prompts, self.capacities, self.share = prompts, capacities, share
        self.page_size = page_size
        self.pool = SlotPool(total_pages)
        self.refs = [0] * total_pages
        self.by_hash: dict[bytes, int] = {}
        self.page_hash: dict[int, bytes] = {}
        self.pending: dict[int, int] = {}  # page -> sequence that will compute it
        self.pending_of: dict[int, list[int]] = {}  # sequence -> the pages it will compute
        self.twins_of: dict[int, list[int]] = {}  # owner -> its admitted twins
        self.evictable: OrderedDict[int, None] = OrderedDict()  # named pages no sequence holds
        self.seqs: dict[int, _Seq] = {}
        self.round: dict[tuple[int, ...], int] = {}  # this admission round's prompts -> owner
        self.reused_tokens = 0  # prompt positions served from shared pages

    @property
    def slots(self) -> int:
        return self.pool.capacity * self.page_size

    # ---- admission ----
    def start_round(self) -> None:
        """Twins are matched within one admission round (they must be prefilled together)."""
        self.round = {}

    def admit(self, j: int) -> bool:
        """Reserve sequence j's pages (sharing what it can); False when the free pages do not suffice."""
        prompt, ps = self.prompts[j], self.page_size
        total = pages_for(self.capacities[j], ps)
        owner = self.round.get(tuple(prompt)) if self.share[j] else None
        if owner is not None:
            return self._admit_twin(j, owner, total)
        hashes = block_hashes(prompt, ps)
        reuse = []
        if self.share[j]:
            for h in hashes[: (len(prompt) - 1) // ps]:
                page = self.by_hash.get(h)
                if page is None:
                    break
                reuse.append(page)
        fresh = self._take(total - len(reuse), exclude=reuse)
        if fresh is None:
            return False
        s = _Seq(reuse + fresh, cached=len(reuse) * ps)
        for page in reuse:
            self._hold(page)
            if page in self.pending:
                s.after.add(self.pending[page])
        for i in range(len(reuse), len(hashes)):  # name the full prompt pages it computes
            if hashes[i] not in self.by_hash:
                self.by_hash[hashes[i]] = s.pages[i]
                self.page_hash[s.pages[i]] = hashes[i]
                self.pending[s.pages[i]] = j
                self.pending_of.setdefault(j, []).append(s.pages[i])
        self.seqs[j] = s
        self.reused_tokens += s.cached
        if self.share[j]:
            self.round.setdefault(tuple(prompt), j)
        return True

    def _admit_twin(self, j: int, owner: int, total: int) -> bool:
        ps, n = self.page_size, len(self.prompts[j])
        shared = self.seqs[owner].pages[: pages_for(n, ps)]
        partial = n % ps != 0
        fresh = self._take(total - len(shared) + partial, exclude=[])
        if fresh is None:
            return False
        for page in shared:
            self._hold(page)
        s = _Seq(shared + fresh[: total - len(shared)], cached=n, twin_of=owner)
        s.cow_page = fresh[-1] if partial else None
        self.seqs[j] = s
        self.twins_of.setdefault(owner, []).append(j)
        self.reused_tokens += n
        return True

    def _hold(self, page: int) -> None:
        self.refs[page] += 1
        self.evictable.pop(page, None)

    def _take(self, n: int, exclude: list[int]) -> list[int] | None:
        """n free pages (one consecutive run when there is one), evicting named free pages as needed
        but never those in `exclude` (about to be reused)."""
        keep = set(exclude)
        spare = len(self.evictable) - sum(1 for p in keep if p in self.evictable)  # O(reused), not O(evictable)
        if n > self.pool.free_slots + spare:
            return None
        if n == 0:
            return []
        start = self.pool.take(n)
        while start is None and (page := self._oldest_evictable(keep)) is not None:
            if self._evict(page) >= n:  # the freed page closed a gap: a run of n is there now
                start = self.pool.take(n)
        if start is not None:
            pages = list(range(start, start + n))
        else:  # fragmented: page by page
            while self.pool.free_slots < n:
                self._evict(self._oldest_evictable(keep))
            pages = [self.pool.take(1) for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def _oldest_evictable(self, keep: set[int]) -> int | None:
        """The least recently freed named page not in `keep` (it skips at most len(keep) pages)."""
        return next((p for p in self.evictable if p not in keep), None)

    def _evict(self, page: int) -> int:
        """Forget a named free page -> the size of the free region it joins."""
        del self.evictable[page]
        del self.by_hash[self.page_hash.pop(page)]
        return self.pool.give(page, 1)

    # ---- prefill ----
    def twins(self, j: int) -> list[int]:
        return [t for t in self.twins_of.get(j, []) if t in self.seqs]

    def cached(self, j: int) -> int:
        return self.seqs[j].cached

    def prefill_waves(self, new: list[int]) -> list[list[int]]:
        """The admitted sequences that compute, in waves: each after the owners of the pending pages
        it reads (twins compute nothing; they take their owner's logits)."""
        wave: dict[int, int] = {}
        for j in new:  # owners are admitted before whoever reuses their pages
            s = self.seqs[j]
            if s.twin_of is None:
                wave[j] = 1 + max((wave.get(o, -1) for o in s.after), default=-1)
        out: list[list[int]] = [[] for _ in range(1 + max(wave.values(), default=-1))]
        for j, w in wave.items():
            out[w].append(j)
        return out

    def computed(self, done: list[int]) -> None:
        """These sequences were prefilled: the pages they named now hold their KV."""
        for j in done:
            for page in self.pending_of.pop(j, []):
                if self.pending.get(page) == j:
                    del self.pending[page]

    def layout(self, rows: list[int], with_starts: bool = False) -> PagedLayout:
        pages = [self.seqs[j].pages for j in rows]
        width = max(map(len, pages))
        # one tensor from padded lists: a tensor per row costs ~10 us each, every decode step
        table = torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int64).reshape(len(rows), width)
        starts = torch.tensor([self.seqs[j].cached for j in rows], dtype=torch.int64) if with_starts else None
        return PagedLayout(table, self.page_size, starts, torch.tensor(rows, dtype=torch.int64))

    # ---- decode ----
    def copy_on_write(self, writes: dict[int, int]) -> list[tuple[int, int]]:
        """Before a decode step that writes position writes[j] of each sequence j: every sequence
        about to write into a page it shares gets its reserved copy -> (source, destination) pages."""
        copies = []
        for j, position in writes.items():
            s = self.seqs[j]
            if s.cow_page is None:
                continue
            i = position // self.page_size
            page = s.pages[i]
            if self.refs[page] > 1:
                copies.append((page, s.cow_page))
                s.pages[i] = s.cow_page
                self.refs[page] -= 1
            else:  # the others left: the page is its own now
                self.refs[s.cow_page] = 0
                self.pool.give(s.cow_page, 1)
            s.cow_page = None
        return copies

    def release(self, j: int) -> int:
        """Sequence j finished: its pages lose a holder; named ones stay findable until evicted.
        Returns j, the id executors know it by (the layout's `keys`: twins share their first page)."""
        s = self.seqs.pop(j)
        self.pending_of.pop(j, None)
        if s.twin_of is not None and s.twin_of not in self.seqs:
            self.twins_of.pop(s.twin_of, None)  # the owner and this twin are gone
        if j in self.twins_of and not any(t in self.seqs for t in self.twins_of[j]):
            del self.twins_of[j]
        for page in s.pages + ([s.cow_page] if s.cow_page is not None else []):
            self.refs[page] -= 1
            if self.refs[page] > 0:
                continue
            if page in self.page_hash and page not in self.pending:
                self.evictable[page] = None
            else:
                if page in self.page_hash:  # named but never computed (its owner failed): forget it
                    del self.by_hash[self.page_hash.pop(page)]
                    del self.pending[page]
                self.pool.give(page, 1)
        return j
