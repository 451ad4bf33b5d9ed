"""The baselines: no prediction, eviction by one array of scores.

- `on-demand`: evict the expert loaded longest ago (FIFO).
- `lru`: evict the least recently used.
- `lfu`: evict the one that served the fewest tokens so far.
"""

from __future__ import annotations

import numpy as np

from moelight.expert_cache.cache_policy import CachePolicy


class OnDemand(CachePolicy):
    name = "on-demand"

    def __init__(self, layers: int, experts: int) -> None:
        super().__init__(layers, experts)
        self.load_tick = np.zeros(self.keys)

    def loaded(self, key: int, tick: int) -> None:
        self.load_tick[key] = tick

    def scores(self, resident: np.ndarray) -> np.ndarray:
        return self.load_tick


class LRU(CachePolicy):
    name = "lru"

    def __init__(self, layers: int, experts: int) -> None:
        super().__init__(layers, experts)
        self.last = np.zeros(self.keys)

    def touched(self, key: int, tick: int) -> None:
        self.last[key] = tick

    def scores(self, resident: np.ndarray) -> np.ndarray:
        return self.last


class LFU(CachePolicy):
    name = "lfu"

    def __init__(self, layers: int, experts: int) -> None:
        super().__init__(layers, experts)
        self.tokens = np.zeros(self.keys)
        self.last = np.zeros(self.keys)

    def observe(self, layer: int, counts: dict[int, np.ndarray]) -> None:
        for c in counts.values():
            self.tokens[layer * self.E : (layer + 1) * self.E] += c

    def touched(self, key: int, tick: int) -> None:
        self.last[key] = tick

    def scores(self, resident: np.ndarray) -> np.ndarray:
        return self.tokens + self.last * 1e-9  # ties: the least recently used goes first
