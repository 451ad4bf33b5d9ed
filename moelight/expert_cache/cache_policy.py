"""The interface of an expert-cache policy: what a device expert cache keeps, and what it fetches
before it is asked.

A policy sees the routing of every MoE layer pass (`observe`) and every access (`touched`,
`loaded`), and answers two questions with arrays over all L x E experts (key = layer * E +
expert): `scores()`, the keep-worthiness of each (the cache evicts the lowest), and
`prefetch(layer)`, a priority for fetching each ahead of its use (0: do not). Pure numpy, no
torch: the runtime (cache_executor.py) and the trace simulator (cache_simulator.py) drive the same
objects. The policies themselves: baseline_policies.py, moe_infinity_policy.py,
learned_policies.py, combined_policy.py; by name: policy_registry.py.
"""

from __future__ import annotations

import numpy as np

UNBOUNDED = 1 << 30  # a policy's prefetch budget: every expert it names


class CachePolicy:
    """No prediction, eviction by one array of scores; subclasses say what the scores are."""

    name = "base"
    predicts = False  # it proposes prefetches
    per_layer = False  # each layer keeps its share of the slots (ProMoE's per-layer cache)
    cpu_offload = False  # a miss with few tokens runs on the CPU instead (CoServe's placement)
    stream_prefill = False  # prefill streams experts through two slots outside the cache (DuoServe)
    copy_chunks = 1  # copies in this many chunks, so a demand overtakes a prefetch between them (ProMoE)
    reorder = False  # cached experts compute first, experts still arriving last (ProMoE)
    wants_hidden = False  # its predictor reads each MoE block's input (`observe_hidden`)
    prefetch_budget: int | None = None  # its own prefetches per layer pass (None: the link's; UNBOUNDED: all
    # it names); --prefetch-per-layer wins over it
    prefetch_outranks_cache = False  # a prediction evicts the lowest-scored expert even if it outranks it

    def __init__(self, layers: int, experts: int) -> None:
        self.L, self.E = layers, experts
        self.keys = layers * experts

    def begin(self, seq: int) -> None:
        """A sequence starts (its KV slot and id may be reused by an earlier one)."""

    def end(self, seq: int) -> None:
        """A sequence finished."""

    def observe(self, layer: int, counts: dict[int, np.ndarray]) -> None:
        """The routing of one pass of `layer`: tokens each sequence sent to each expert [E]."""

    def touched(self, key: int, tick: int) -> None:
        """An access at logical time `tick` (hit or miss)."""

    def loaded(self, key: int, tick: int) -> None:
        """The key was given a slot (demand or prefetch) at `tick`."""

    def predicted_cached(self, key: int, tick: int) -> None:
        """A prediction named an expert that is cached already."""

    def observe_hidden(self, layer: int, hidden: np.ndarray) -> None:
        """The MoE block's input [tokens, hidden] of this pass (for policies with `wants_hidden`)."""

    def scores(self, resident: np.ndarray) -> np.ndarray:
        """Keep-worthiness of every key [L*E] (the lowest cached one is evicted first)."""
        raise NotImplementedError

    def prefetch(self, layer: int) -> np.ndarray | None:
        """Priorities [L*E] after `layer`'s routing (higher first, <= 0 never), or None."""
        return None
