"""Which sequences run: admission into the KV pool, refill, and micro-batch placement.

The scheduler owns the waiting queue, the KV-cache regions (a first-fit `SlotPool` over one
ragged pool) and the micro-batches; it never runs the model (engine/generation.py does, through
an executor), as nano-vllm's Scheduler hands work to its ModelRunner. Each sequence owns one
contiguous region of prompt + max new tokens slots for its whole life, so the attention kernels
read one block per (sequence, head), and its region's start is its KV offset.

refill=True: when at least N/8 of the N slots are free, waiting sequences are admitted into the
freed regions and placed into the least-filled micro-batches. The first admission (and every
admission into an empty run) balances micro-batches by prompt tokens (paper Alg. 2).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from moelight.engine.batching import balance_microbatches
from moelight.engine.sequence import Sequence
from moelight.engine.slot_pool import SlotPool


class Scheduler:
    def __init__(self, seqs: list[Sequence], batch_size: int, micro_batch_size: int) -> None:
        self.seqs = seqs
        self.sizes = [s.kv_slots for s in seqs]
        self.n = max(1, min(batch_size, len(seqs)))
        self.mu = max(1, micro_batch_size)
        self.capacity = sum(sorted(self.sizes, reverse=True)[: self.n])  # holds any n of them at once
        self.pool = SlotPool(self.capacity)
        self.offsets = torch.zeros(len(seqs), dtype=torch.int64)
        self.micro_batches: list[list[int]] = [[] for _ in range(math.ceil(self.n / self.mu))]
        self.waiting = deque(range(len(seqs)))
        self.refill_at = max(1, self.n // 8)

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
        while self.waiting and len(new) < self.n - running:
            start = self.pool.take(self.sizes[self.waiting[0]])
            if start is None:  # wait for a region to free up; keep the request order
                break
            j = self.waiting.popleft()
            self.offsets[j] = start
            new.append(j)
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
                n = self.seqs[j].prompt_len
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
        """Sequence j ended: it leaves its micro-batch and its region is free; returns its KV offset."""
        for mb in self.micro_batches:
            if j in mb:
                mb.remove(j)
        offset = int(self.offsets[j])
        self.pool.give(offset, self.sizes[j])
        return offset
