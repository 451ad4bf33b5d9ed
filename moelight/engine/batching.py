"""Request batching: batches of N sequences, micro-batches balanced by tokens (paper Alg. 2)."""

from __future__ import annotations

import heapq


def balance_microbatches(lengths: list[int], num_microbatches: int) -> list[list[int]]:
    """Longest first, each into the micro-batch with the fewest tokens so far.

    Returns lists of indices into `lengths`; empty micro-batches are dropped. Ragged
    attention means no padding, so balanced token counts mean balanced work.
    """
    n_mb = max(1, min(num_microbatches, len(lengths)))
    heap = [(0, j) for j in range(n_mb)]
    groups: list[list[int]] = [[] for _ in range(n_mb)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, j = heapq.heappop(heap)
        groups[j].append(i)
        heapq.heappush(heap, (tokens + lengths[i], j))
    return [sorted(g) for g in groups if g]


def split_batches(n_requests: int, batch_size: int) -> list[range]:
    """Consecutive batches of at most batch_size requests (keeps output roughly in input order)."""
    return [range(s, min(s + batch_size, n_requests)) for s in range(0, n_requests, batch_size)]
