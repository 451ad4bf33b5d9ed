"""The device expert cache as a deterministic state machine: slots, page table, fetch decisions.

Which experts occupy the slots depends only on the routing and the policy, never on timing:
an expert counts as cached from the moment it is given a slot (its copy may still be under
way). So the runtime (real copies on a link) and the trace simulator (copies timed with HRM
costs) make the same decisions and count the same hits from the same routing; only when a copy
completes, and so the stalls, differ. Per MoE layer pass a driver calls:

1. `access(layer, counts)`: the layer's routing (tokens per expert per sequence). Needed experts
   already holding a slot are hits; the others are misses, each given a slot now (a demand fetch
   the driver moves ahead of every prefetch). The layer's needed experts are locked: nothing
   evicts them until its next call.
2. `plan_prefetch(layer)`: up to `prefetch_per_layer` experts the policy ranks highest and that
   are not cached, each given a slot whose current owner scores lower than the newcomer.

Evicting an expert whose copy has not started cancels it (`cancelled`): the driver drops it.
Policies may also ask for a per-layer partition (each layer keeps at least its share of the
slots; ProMoE), and to run a missed expert with few tokens on the CPU instead of fetching it
(`cpu_max_tokens`, CoServe's K*n + B placement): `cpu_now` lists them after `access`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from moelight.errors import MoelightError
from moelight.expert_cache.cache_policy import CachePolicy


class CacheConfigError(MoelightError):
    """A cache that cannot work (fewer slots than one layer's experts, ...)."""


@dataclass
class Fetch:
    """Copy expert `key` (layer * E + expert) into `slot`; demand fetches go before prefetches."""

    key: int
    slot: int
    demand: bool
    priority: float
    order: int  # issue order, the tie-break in the copy queue
    source: int = -1  # the expert copied, when not `key` (a prefill's streaming copy outside the cache)


@dataclass
class CacheStats:
    accesses: int = 0  # needed experts over all layer passes
    hits: int = 0
    misses: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # accessed before eviction
    prefetch_late: int = 0  # accessed while its copy was still under way (set by the driver)
    prefetch_wasted: int = 0  # evicted (or cancelled) without use
    cpu_executed: int = 0  # misses run on the CPU next to the expert's host copy instead of fetched
    streamed: int = 0  # experts a prefill streamed through its own two slots, outside the cache
    cancelled: int = 0  # evicted before its copy started: never moved
    fetched_bytes: float = 0.0  # bytes the copies moved (set by the driver)
    layer_passes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Of the accesses a plain cache could not serve from an earlier use, the share a prediction
        brought in: used prefetches / (used prefetches + misses)."""
        rescued = self.prefetch_used + self.misses
        return self.prefetch_used / rescued if rescued else 0.0

    @property
    def good_pred(self) -> float:
        """GoodPred: recall x the share of used prefetches that arrived in time."""
        if not self.prefetch_used:
            return 0.0
        return self.prefetch_recall * (self.prefetch_used - self.prefetch_late) / self.prefetch_used

    def to_dict(self) -> dict:
        return asdict(self) | {"hit_rate": self.hit_rate, "prefetch_recall": self.prefetch_recall,
                               "good_pred": self.good_pred}


@dataclass
class ExpertCache:
    layers: int
    experts: int
    slots: int
    policy: CachePolicy
    prefetch_per_layer: int = 0  # the link's budget, or the user's (prefetch_given)
    cpu_max_tokens: int = 0  # with a policy that offloads: a miss of at most this many tokens runs on the CPU
    stats: CacheStats = field(default_factory=CacheStats)
    prefetch_given: bool = False  # --prefetch-per-layer: it wins over a policy's own budget

    @property
    def budget(self) -> int:
        """Prefetches per layer pass: the user's where given, else the policy's own, else the link's."""
        own = self.policy.prefetch_budget
        return self.prefetch_per_layer if own is None or self.prefetch_given else own

    def __post_init__(self) -> None:
        if self.slots < self.experts:
            raise CacheConfigError(f"an expert cache of {self.slots} slots cannot hold one layer's {self.experts} "
                                   f"experts; give it at least {self.experts} (a prefill pass may need them all)")
        n = self.layers * self.experts
        self.slot_of = np.full(n, -1, np.int64)  # key -> slot, -1: not cached
        self.key_of = np.full(self.slots, -1, np.int64)
        self.unused_prefetch = np.zeros(n, bool)
        self.free = list(range(self.slots - 1, -1, -1))
        self.locked: set[int] = set()
        self.tick = 0
        self.order = 0
        self.evicted_now: list[int] = []  # keys evicted by the last call (the driver cancels their copies)
        self.cpu_now: list[int] = []  # experts of the last access that run on the CPU
        self.quota = self.slots // self.layers if getattr(self.policy, "per_layer", False) else 0

    def cached(self, key: int) -> bool:
        return self.slot_of[key] >= 0

    # ---- per layer pass ----
    def access(self, layer: int, counts: dict[int, np.ndarray]) -> tuple[list[int], list[Fetch]]:
        """The layer's needed experts (ascending) and the demand fetches for its misses."""
        self.policy.observe(layer, counts)
        total = sum(counts.values())
        needed = [int(e) for e in np.flatnonzero(total)]
        self.locked = {layer * self.experts + e for e in needed}
        self.evicted_now, self.cpu_now = [], []
        self.stats.layer_passes += 1
        offload = self.cpu_max_tokens if getattr(self.policy, "cpu_offload", False) else 0
        fetches = []
        for e in needed:
            key = layer * self.experts + e
            self.tick += 1
            self.stats.accesses += 1
            if self.cached(key):
                self.stats.hits += 1
                if self.unused_prefetch[key]:
                    self.unused_prefetch[key] = False
                    self.stats.prefetch_used += 1
            elif total[e] <= offload:
                self.stats.misses += 1
                self.stats.cpu_executed += 1
                self.cpu_now.append(e)
            else:
                self.stats.misses += 1
                fetches.append(self._admit(key, demand=True, priority=float("inf")))
            self.policy.touched(key, self.tick)
        return needed, fetches

    def plan_prefetch(self, layer: int) -> list[Fetch]:
        """Prefetches after `layer`'s routing, highest priority first, within the per-layer budget."""
        self.evicted_now = []
        budget = self.budget
        prio = self.policy.prefetch(layer) if budget else None
        if prio is None:
            return []
        out: list[Fetch] = []
        for key in np.argsort(-prio, kind="stable"):
            if len(out) >= budget or prio[key] <= 0:
                break
            key = int(key)
            if self.cached(key):
                self.policy.predicted_cached(key, self.tick)
                continue
            below = None if self.policy.prefetch_outranks_cache else float(prio[key])
            if not self.free and self._victim(key, below=below) is None:
                break  # everything cached outranks the rest of the list
            out.append(self._admit(key, demand=False, priority=float(prio[key])))
            self.locked.add(key)  # this round's prefetches do not evict each other
            self.unused_prefetch[key] = True
            self.stats.prefetch_issued += 1
        return out

    def release(self, seq: int) -> None:
        self.policy.end(seq)

    # ---- slots ----
    def _victim(self, for_key: int, below: float | None = None) -> int | None:
        """The unlocked cached key with the lowest score (only if lower than `below`); with a
        per-layer partition, from the incoming key's layer once it holds its share, else from the
        layers holding more than theirs."""
        resident = self.slot_of >= 0
        scores = np.where(resident, self.policy.scores(resident), np.inf)
        if self.locked:
            scores[list(self.locked)] = np.inf
        if self.quota:
            held = (self.slot_of.reshape(self.layers, self.experts) >= 0).sum(1)
            layer = for_key // self.experts
            rows = [layer] if held[layer] >= self.quota else list(np.flatnonzero(held > self.quota))
            part = np.full(self.layers, np.inf)
            part[rows] = 0.0
            narrowed = scores + np.repeat(part, self.experts)
            if np.isfinite(narrowed).any():
                scores = narrowed
        key = int(np.argmin(scores))
        if not np.isfinite(scores[key]) or (below is not None and scores[key] >= below):
            return None
        return key

    def _admit(self, key: int, demand: bool, priority: float) -> Fetch:
        if self.free:
            slot = self.free.pop()
        else:
            victim = self._victim(key)
            if victim is None:
                raise CacheConfigError("every cached expert is in use by this layer: the cache is too small")
            slot = int(self.slot_of[victim])
            self.slot_of[victim] = -1
            if self.unused_prefetch[victim]:
                self.unused_prefetch[victim] = False
                self.stats.prefetch_wasted += 1
            self.evicted_now.append(victim)
        self.slot_of[key], self.key_of[slot] = slot, key
        self.policy.loaded(key, self.tick)
        self.order += 1
        return Fetch(key, slot, demand, priority, self.order)
