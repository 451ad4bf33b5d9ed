"""Which sequences run: admission into the KV pool, refill, and micro-batch placement.

The scheduler owns the waiting queue, the KV placement and the micro-batches; it never runs the
model (engine/generation.py does, through an executor), as nano-vllm's Scheduler hands work to its
ModelRunner. The placement is either ragged regions (engine/kv_regions.py: one contiguous region of
prompt + max new tokens slots per sequence) or pages with prefix sharing (engine/block_manager.py);
either way a sequence reserves all the room it may fill when it is admitted, so a running sequence never
waits. The paged pool counts each shared prefix once (runtime/paged_layout.pool_table), not once per
sequence: a sequence is admitted only when the block manager can reserve its pages, and where sharing
turns out smaller than counted (its prefix's pages were recycled) it waits for running ones to finish;
an empty pool holds any one sequence, so it never waits on nothing.

refill=True: when at least N/8 of the N slots are free, waiting sequences are admitted into the
freed regions and placed into the least-filled micro-batches. The first admission (and every
admission into an empty run) balances micro-batches by prompt tokens (paper Alg. 2).
"""

from __future__ import annotations

import math
from collections import deque

from moelight.engine.batching import balance_microbatches
from moelight.engine.block_manager import PAGE_SIZE, BlockManager, pages_for
from moelight.engine.kv_regions import RegionKV
from moelight.engine.sequence import Sequence
from moelight.runtime.paged_layout import pool_slots


class Scheduler:
    def __init__(self, seqs: list[Sequence], batch_size: int, micro_batch_size: int,
                 prompts: list[list[int]] | None = None) -> None:
        """`prompts`: page the KV cache and share common prefixes among these prompts (None: ragged regions)."""
        self.seqs = seqs
        self.sizes = [s.kv_slots for s in seqs]
        self.n = max(1, min(batch_size, len(seqs)))
        self.mu = max(1, micro_batch_size)
        if prompts is None:
            self.kv = RegionKV(self.sizes, pool_slots(self.sizes, self.n, paged=False))
        else:  # shared prefixes counted once per distinct prefix live at once: admission waits for pages
            share = [s.params.prompt_logprobs is None for s in seqs]
            slots = pool_slots(self.sizes, self.n, True, prompts, share)
            if slots < pages_for(max(self.sizes, default=0)) * PAGE_SIZE:  # an empty pool must admit anything
                raise RuntimeError(f"KV pool of {slots} slots cannot hold the largest sequence (engine bug)")
            self.kv = BlockManager(prompts, self.sizes, slots // PAGE_SIZE, share, PAGE_SIZE)
        self.micro_batches: list[list[int]] = [[] for _ in range(math.ceil(self.n / self.mu))]
        self.waiting = deque(range(len(seqs)))
        self.refill_at = max(1, self.n // 8)

    @property
    def capacity(self) -> int:
        """Token slots the KV cache must hold."""
        return self.kv.slots

    @property
    def running(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    def admit(self) -> list[int]:
        """Waiting sequences that enter now (in order, while slots and a region are free), placed
        into micro-batches; [] when it is not time to refill or nothing fits yet."""
        running = self.running
        if not self.waiting or (running and self.n - running < self.refill_at):
            return []
        new = []
        self.kv.start_round()
        while self.waiting and len(new) < self.n - running:
            if not self.kv.admit(self.waiting[0]):  # wait for room to free up; keep the request order
                break
            new.append(self.waiting.popleft())
        if new:
            self._place(new)
        elif not running:
            raise RuntimeError("KV pool cannot hold the next request (engine bug: pool too small)")
        return new

    def _place(self, new: list[int]) -> None:
        """Into an empty run: balanced micro-batches (Alg. 2); else the least-filled ones."""
        if not self.running:
            groups = balance_microbatches([self.seqs[j].prompt_len for j in new], math.ceil(len(new) / self.mu))
            for k, g in enumerate(groups):
                self.micro_batches[k] = [new[i] for i in g]
            return
        for j in new:
            min(self.micro_batches, key=len).append(j)

    def prefill_chunks(self, new: list[int], max_tokens: int) -> list[list[int]]:
        """The admitted sequences by micro-batch, each cut so a prefill pass holds at most
        `max_tokens` prompt tokens (a pass never mixes micro-batches: executors size buffers by one)."""
        fresh = set(new)
        chunks = []
        for mb in self.micro_batches:
            cur, tokens = [], 0
            for j in (j for j in mb if j in fresh):
                n = self.seqs[j].prompt_len - self.kv.cached(j)
                if cur and tokens + n > max_tokens:
                    chunks.append(cur)
                    cur, tokens = [], 0
                cur.append(j)
                tokens += n
            if cur:
                chunks.append(cur)
        return chunks

    def decode_batches(self) -> list[list[int]]:
        """The running micro-batches, as they are now (a finishing sequence leaves its own at once)."""
        return [list(mb) for mb in self.micro_batches if mb]

    def finish(self, j: int) -> int:
        """Sequence j ended: it leaves its micro-batch and its room is free; returns the id executors know
        it by (ragged: its KV offset; paged: j)."""
        for mb in self.micro_batches:
            if j in mb:
                mb.remove(j)
        return self.kv.release(j)
