"""First-fit allocator of contiguous KV-cache token slots, for refilling a running batch.

A sequence owns one contiguous region (prompt + max new tokens), as in RaggedKVCache,
so the attention kernel still reads one block per (sequence, head). Freed regions are
merged with their free neighbours, so a pool that has drained is one region again.
"""

from __future__ import annotations

import bisect
import itertools


class SlotPool:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []  # free regions, sorted by start
        self._sizes: list[int] = [capacity] if capacity else []
        self._free = capacity  # sum(self._sizes), kept: a fragmented pool has thousands of regions

    @property
    def free_slots(self) -> int:
        return self._free

    def take(self, n: int) -> int | None:
        """Start of a region of n slots (the first free region that fits), or None."""
        if n <= 0:
            raise ValueError("a region needs at least one slot")
        # the first region that fits, found at C speed: a fragmented pool has thousands of regions
        j = next(itertools.compress(itertools.count(), map(n.__le__, self._sizes)), None)
        if j is None:
            return None
        start, size = self._starts[j], self._sizes[j]
        if size == n:
            del self._starts[j], self._sizes[j]
        else:
            self._starts[j] += n
            self._sizes[j] -= n
        self._free -= n
        return start

    def give(self, start: int, n: int) -> int:
        """Return the region [start, start + n), merging it with adjacent free regions -> the size of
        the free region it is now part of."""
        j = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[j - 1] + self._sizes[j - 1] if j else -1
        if start < 0 or start + n > self.capacity or prev_end > start or (
                j < len(self._starts) and start + n > self._starts[j]):
            raise ValueError(f"region [{start}, {start + n}) is not in use")
        self._free += n
        if j < len(self._starts) and self._starts[j] == start + n:  # merge with the next
            n += self._sizes[j]
            del self._starts[j], self._sizes[j]
        if j and prev_end == start:  # merge with the previous
            self._sizes[j - 1] += n
            return self._sizes[j - 1]
        self._starts.insert(j, start)
        self._sizes.insert(j, n)
        return n
