"""MoE-Infinity's policy (paper 004, sections 5-6): per-sequence Expert Activation Matrices.

After each layer, every active sequence's EAM is matched to the EAM collection (Eq. 1 over the
layers it has seen) and the matched EAM's activation shares give the experts of the layers
ahead priority (share + eps) x (1 - d / L), d the layers ahead (wrapping into the next token's
layers); eviction uses the same score on the sequences' own EAMs.
"""

from __future__ import annotations

import numpy as np

from moelight.expert_cache.cache_policy import CachePolicy
from moelight.expert_cache.eam import EAMCollection

EPSILON = 1e-3  # MoE-Infinity's EPSILON: experts with a zero share still ordered by layer distance


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


def _row_share(m: np.ndarray) -> np.ndarray:
    tot = m.sum(-1, keepdims=True)
    return np.divide(m, tot, out=np.zeros_like(m, dtype=np.float64), where=tot > 0)
