"""The page tables latency mode's executor hands `expert_mix`: a layer's experts by id, each a view
of the device slot it occupies, waited for at its first use so experts compute as their copies land."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moelight.expert_cache.cache_state import Fetch

if TYPE_CHECKING:
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor


class SlotTable:
    """A layer's page table as expert_mix indexes it: a slot view that is waited for when first
    used (so the experts compute as they arrive)."""

    def __init__(self, ex: ExpertCacheExecutor, layer: int, on_device: list[int]) -> None:
        self.ex, self.layer = ex, layer
        self.slot = {e: int(ex.cache.slot_of[layer * ex.E + e]) for e in on_device}
        self.slots = list(self.slot.values())
        self.gate_up, self.down = TableView(self, True), TableView(self, False)

    def get(self, e: int, gate_up: bool) -> torch.Tensor:
        if gate_up:  # the expert's first use: its copy must be done
            self.ex.worker.wait(self.layer * self.ex.E + e)
        return self.ex.slots.on_device(self.slot[e], gate_up)


class StreamTable:
    """DuoServe's two streaming slots: expert n+1 is copied into the slot expert n-1 used, while
    expert n computes."""

    def __init__(self, ex: ExpertCacheExecutor, layer: int, needed: list[int]) -> None:
        self.ex, self.layer, self.needed = ex, layer, needed
        self.keys: dict[int, int] = {}
        for n in range(min(2, len(needed))):
            self._copy(n)
        self.gate_up, self.down = TableView(self, True), TableView(self, False)

    def _copy(self, n: int) -> None:
        count = next(self.ex.stream_count)
        key, slot = -1 - count, self.ex.stream_slots[n % 2]  # keys outside the cache's, in issue order
        self.keys[n] = key
        self.ex.worker.submit([Fetch(key, slot, True, float("inf"), count, self.layer * self.ex.E + self.needed[n])])

    def get(self, e: int, gate_up: bool) -> torch.Tensor:
        n = self.needed.index(e)
        slot = self.ex.stream_slots[n % 2]
        if gate_up:
            if n >= 1 and n + 1 < len(self.needed):  # expert n-1 is done: its slot takes expert n+1
                self.ex.worker.used([self.ex.stream_slots[(n + 1) % 2]])
                self._copy(n + 1)
            self.ex.worker.wait(self.keys[n])
        return self.ex.slots.on_device(slot, gate_up)


class TableView:
    """One of a table's two weights (gate-up or down) indexed by expert, as expert_mix reads them."""

    def __init__(self, table, gate_up: bool) -> None:
        self.table, self.gate_up = table, gate_up

    def __len__(self) -> int:
        return self.table.ex.E

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.table.get(int(e), self.gate_up)
