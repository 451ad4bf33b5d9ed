"""The cache policies of ProMoE, DuoServe-MoE and CoServe, on the shared expert cache (numpy only).

- `promoe` (paper 002): per layer l a learned MLP reads layer l's MoE input and names the experts
  of layer l + 2 (stride prefetching); they are prefetched at once, in three chunks each, behind
  demand fetches; cached experts compute before the ones still arriving; the cache is a
  per-layer LRU, and a prediction that names a cached expert refreshes it.
- `duoserve` (paper 000): prefill streams each layer's experts through two slots of its own
  (the cache serves decode only); in decode, an MLP reads the token's expert path, the next
  layer's popularity and the affinity of this layer's experts, and its top-k for the next
  layer are prefetched; LRU otherwise.
- `coserve` (paper 003, its expert management for a MoE layer): eviction in two stages, first
  the experts whose predecessors (the previous layer's experts that lead to them, by the
  affinity) are not resident, then by usage probability (the profile's popularity); and a miss
  with few tokens runs on the CPU next to its host copy when K*n + B says that is sooner than
  fetching it (the cache's `cpu_max_tokens`, from the HRM's costs).
"""

from __future__ import annotations

import numpy as np

from moelight.expert_cache.baseline_policies import LRU
from moelight.expert_cache.cache_policy import UNBOUNDED, CachePolicy
from moelight.expert_cache.predictors import Predictors, duoserve_features, sigmoid


class ProMoE(LRU):
    name = "promoe"
    predicts = True
    per_layer = True
    copy_chunks = 3
    reorder = True
    wants_hidden = True
    prefetch_budget = UNBOUNDED  # whatever the predictor names
    prefetch_outranks_cache = True  # a prediction enters the LRU like an access (its scores are ticks)

    def __init__(self, layers: int, experts: int, predictors: Predictors) -> None:
        super().__init__(layers, experts)
        self.pred, self.k = predictors, predictors.top_k
        self.pending: tuple[int, np.ndarray] | None = None  # (target layer, priorities [E])

    def observe_hidden(self, layer: int, hidden: np.ndarray) -> None:
        mlp = self.pred.mlps.get(layer)
        self.pending = None
        if mlp is None or not len(hidden) or layer + self.pred.stride >= self.L:
            return
        probs = sigmoid(mlp(hidden))  # [tokens, E]
        chosen = np.zeros(self.E)
        top = np.argsort(-probs, axis=1)[:, : self.k]
        for t, row in enumerate(top):  # each token's top-k, ranked by the predictor's confidence
            chosen[row] = np.maximum(chosen[row], probs[t, row])
        self.pending = (layer + self.pred.stride, chosen)

    def prefetch(self, layer: int) -> np.ndarray | None:
        if self.pending is None:
            return None
        target, prio = self.pending
        out = np.zeros(self.keys)
        out[target * self.E : (target + 1) * self.E] = prio
        return out

    def predicted_cached(self, key: int, tick: int) -> None:
        self.touched(key, tick)  # the paper: predictions of cached experts delay their eviction


class DuoServe(LRU):
    name = "duoserve"
    predicts = True
    stream_prefill = True
    prefetch_budget = UNBOUNDED
    prefetch_outranks_cache = True

    def __init__(self, layers: int, experts: int, predictors: Predictors) -> None:
        super().__init__(layers, experts)
        self.pred, self.k = predictors, predictors.top_k
        self.paths: dict[int, np.ndarray] = {}  # sequence -> this token's expert path so far [L, E]
        self.pending: np.ndarray | None = None

    def begin(self, seq: int) -> None:
        self.paths[seq] = np.zeros((self.L, self.E))

    def end(self, seq: int) -> None:
        self.paths.pop(seq, None)

    def observe(self, layer: int, counts: dict[int, np.ndarray]) -> None:
        super().observe(layer, counts)
        self.pending = None
        mlp = self.pred.mlps.get(layer) if layer + 1 < self.L else None
        prio = np.zeros(self.E)
        for seq, c in counts.items():
            path = self.paths.setdefault(seq, np.zeros((self.L, self.E)))
            if layer == 0:
                path[:] = 0.0  # a new token
            path[layer] = c > 0
            if mlp is not None and c.sum() <= self.k:  # decode: one token; prefill streams instead
                p = sigmoid(mlp(duoserve_features(path, layer, path[layer], self.pred.profile)[None]))[0]
                top = np.argsort(-p)[: self.k]
                prio[top] = np.maximum(prio[top], p[top])
        if prio.any():
            out = np.zeros(self.keys)
            out[(layer + 1) * self.E : (layer + 2) * self.E] = prio
            self.pending = out

    def prefetch(self, layer: int) -> np.ndarray | None:
        return self.pending


class CoServe(CachePolicy):
    name = "coserve"
    cpu_offload = True

    def __init__(self, layers: int, experts: int, predictors: Predictors) -> None:
        super().__init__(layers, experts)
        self.profile = predictors.profile
        self.usage = predictors.profile.popularity.reshape(-1)

    def scores(self, resident: np.ndarray) -> np.ndarray:
        """Stage 1 (evicted first): experts whose likely predecessors are not resident; stage 2:
        the least probable to be used. Layer 0 depends on nothing."""
        res = resident.reshape(self.L, self.E).astype(float)
        pop, aff = self.profile.popularity, self.profile.affinity
        reach = np.ones((self.L, self.E))
        if self.L > 1:  # P(a token reaching expert j came through a resident expert of the layer before)
            into = np.einsum("li,lij->lj", pop[:-1], aff)
            via = np.einsum("li,lij->lj", pop[:-1] * res[:-1], aff)
            reach[1:] = np.divide(via, into, out=np.zeros_like(via), where=into > 0)
        independent = reach < 0.5
        return self.usage - independent.reshape(-1) * 2.0
