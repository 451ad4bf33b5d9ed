"""Ragged KV placement: each sequence one contiguous region of prompt + max new tokens slots.

The placement the engine uses when it does not page (prefix sharing off, or an executor that reads
only ragged offsets); it answers the scheduler's questions as engine/block_manager.py does for
pages, with nothing shared: every admitted sequence computes its whole prompt in one wave.
"""

from __future__ import annotations

import torch

from moelight.engine.slot_pool import SlotPool


class RegionKV:
    page_size = 1  # no pages: nothing is ever copied

    def __init__(self, sizes: list[int], total_slots: int) -> None:
        self.sizes = sizes
        self.pool = SlotPool(total_slots)
        self.offsets = torch.zeros(len(sizes), dtype=torch.int64)
        self.reused_tokens = 0

    @property
    def slots(self) -> int:
        return self.pool.capacity

    def start_round(self) -> None:
        """Nothing is matched across an admission round."""

    def admit(self, j: int) -> bool:
        start = self.pool.take(self.sizes[j])
        if start is None:
            return False
        self.offsets[j] = start
        return True

    def prefill_waves(self, new: list[int]) -> list[list[int]]:
        return [list(new)]

    def twins(self, j: int) -> list[int]:
        return []

    def cached(self, j: int) -> int:
        return 0

    def computed(self, done: list[int]) -> None:
        """Nothing waits on a ragged region."""

    def layout(self, rows: list[int], with_starts: bool = False) -> torch.Tensor:
        return self.offsets[rows]

    def copy_on_write(self, writes: dict[int, int]) -> list[tuple[int, int]]:
        return []

    def release(self, j: int) -> int:
        offset = int(self.offsets[j])
        self.pool.give(offset, self.sizes[j])
        return offset
