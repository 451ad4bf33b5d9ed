"""Expert-cache policies: what a device expert cache keeps, and what it fetches before it is asked.

A policy sees the routing of every MoE layer pass (`observe`) and every access (`touched`,
`loaded`), and answers two questions with arrays over all L x E experts (key = layer * E +
expert): `scores()`, the keep-worthiness of each (the cache evicts the lowest), and
`prefetch(layer)`, a priority for fetching each ahead of its use (0: do not). Pure numpy, no
torch: the runtime (executor.py) and the trace simulator (simulator.py) drive the same objects.

- `on-demand`: no prediction; evict the expert loaded longest ago (FIFO).
- `lru`: no prediction; evict the least recently used.
- `lfu`: no prediction; evict the one that served the fewest tokens so far.
- `moe-infinity` (paper 004, sections 5-6): per-sequence EAMs; after each layer, every active
  sequence's EAM is matched to the EAM collection (Eq. 1 over the layers it has seen) and the
  matched EAM's activation shares give the experts of the layers ahead priority
  (share + eps) x (1 - d / L), d the layers ahead (wrapping into the next token's layers);
  eviction uses the same score on the sequences' own EAMs.
"""

from __future__ import annotations

import numpy as np

from moelight.expert_cache.eam import EAMCollection

EPSILON = 1e-3  # MoE-Infinity's EPSILON: experts with a zero share still ordered by layer distance


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
    prefetch_budget: int | None = None  # prefetches per layer pass whatever the link allows (None: the cache's)
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


class MoEInfinity(CachePolicy):
    name = "moe-infinity"
    predicts = True

    def __init__(self, layers: int, experts: int, eamc: EAMCollection) -> None:
        super().__init__(layers, experts)
        if eamc.shape != (layers, experts):
            raise ValueError(f"EAM collection of {eamc.shape[0]} x {eamc.shape[1]} for a model of {layers} x {experts}")
        self.eamc = eamc
        self.eams: dict[int, np.ndarray] = {}  # sequence -> its EAM so far [L, E]
        self.decay = 1.0 - np.arange(layers) / layers  # (1 - l / L)

    def begin(self, seq: int) -> None:
        self.eams[seq] = np.zeros((self.L, self.E))

    def end(self, seq: int) -> None:
        self.eams.pop(seq, None)

    def observe(self, layer: int, counts: dict[int, np.ndarray]) -> None:
        for seq, c in counts.items():
            self.eams.setdefault(seq, np.zeros((self.L, self.E)))[layer] += c

    def scores(self, resident: np.ndarray) -> np.ndarray:
        """Algorithm 2: (activation share in the current sequences + eps) x (1 - l / L)."""
        if not self.eams:
            return np.repeat(EPSILON * self.decay, self.E)
        cur = sum(self.eams.values())
        share = _row_share(cur)
        return ((share + EPSILON) * self.decay[:, None]).reshape(-1)

    def prefetch(self, layer: int) -> np.ndarray:
        """Algorithm 1's PREFETCH for every active sequence, summed: (predicted share + eps) x
        (1 - d / L) for the layers d = 1..L-1 ahead; the current layer is not prefetched."""
        predicted = np.zeros((self.L, self.E))
        for cur in self.eams.values():
            predicted += _row_share(self.eamc.nearest(cur))
        ahead = (np.arange(self.L) - layer) % self.L  # 0 for this layer
        prio = (predicted + EPSILON) * (1.0 - ahead / self.L)[:, None]
        prio[ahead == 0] = 0.0
        return prio.reshape(-1)


def _row_share(m: np.ndarray) -> np.ndarray:
    tot = m.sum(-1, keepdims=True)
    return np.divide(m, tot, out=np.zeros_like(m, dtype=np.float64), where=tot > 0)


POLICIES = ("on-demand", "lru", "lfu", "moe-infinity", "promoe", "duoserve", "coserve", "combined")
NEEDS_PREDICTOR = ("promoe", "duoserve", "coserve")  # `moelight train-predictor --kind NAME`
OFFLOADING = ("coserve", "combined")  # run a small miss on the CPU (the HRM's latency-mode prediction counts it)


def make_policy(name: str, layers: int, experts: int, eamc: EAMCollection | None = None,
                predictors=None) -> CachePolicy:
    """A policy by name; MoE-Infinity needs an EAM collection, ProMoE / DuoServe / CoServe their
    predictor file (`moelight.expert_cache.predictors.Predictors` of the model's shape)."""
    if name == "moe-infinity":
        if eamc is None:
            raise ValueError("the moe-infinity policy needs an EAM collection (--eamc FILE from `moelight eamc`)")
        return MoEInfinity(layers, experts, eamc)
    if name in NEEDS_PREDICTOR:
        from moelight.expert_cache.learned_policies import CoServe, DuoServe, ProMoE

        if predictors is None or predictors.kind != name:
            raise ValueError(f"the {name} policy needs its predictor file (--predictor FILE from "
                             f"`moelight train-predictor --kind {name}`)")
        return {"promoe": ProMoE, "duoserve": DuoServe, "coserve": CoServe}[name](layers, experts, predictors)
    if name == "combined":
        from moelight.expert_cache.combined_policy import Combined

        return Combined(layers, experts, predictors)
    simple = {"on-demand": OnDemand, "lru": LRU, "lfu": LFU}
    if name not in simple:
        raise ValueError(f"unknown cache policy {name!r}; valid: {', '.join(POLICIES)}")
    return simple[name](layers, experts)
