"""The combined policy: what the four papers' comparison says pays where expert copies are slow.

On a PCIe link an expert copy costs far more than computing it next to its host copy for a few
tokens (Mixtral: 22 ms over a T4's link against ~1-4 ms on the CPU), and even a predictor that
is right 80-90% of the time (ProMoE's, DuoServe's) moves the same bytes as demand fetching, only
earlier. So:
- a miss with few tokens runs on the CPU (CoServe's K*n + B placement): no copy on the critical path;
- the cache keeps the experts that served the most tokens (LFU: the best cache on the traces),
  filled in the background by one copy per layer pass of the most-used expert it lacks, which
  enters only if it outranks the one it would replace (the link is otherwise idle);
- a miss with many tokens (a long prefill) is fetched on demand ahead of the fills, in three
  chunks so it overtakes a fill mid-expert (ProMoE), and cached experts compute first.
With a routing profile (any `moelight train-predictor` file) its popularity seeds the counts.
"""

from __future__ import annotations

import numpy as np

from moelight.expert_cache.baseline_policies import LFU


class Combined(LFU):
    name = "combined"
    predicts = True
    cpu_offload = True
    copy_chunks = 3
    reorder = True
    prefetch_budget = 1

    def __init__(self, layers: int, experts: int, predictors=None) -> None:
        super().__init__(layers, experts)
        if predictors is not None:  # a prior worth a handful of tokens per layer
            self.tokens += 8.0 * predictors.profile.popularity.reshape(-1)

    def prefetch(self, layer: int) -> np.ndarray:
        """Every expert's served tokens: the cache fills the most used one it lacks, if it outranks
        the least used one it holds."""
        return self.tokens + 1e-9
