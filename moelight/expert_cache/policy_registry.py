"""Cache policies by name (`--cache-policy`): the registry imports the policies, never the reverse.

Adding a policy: a `CachePolicy` subclass (cache_policy.py) in a module of its own, its name in
POLICIES and a branch in `make_policy`; the runtime and the trace simulator then both run it.
"""

from __future__ import annotations

from moelight.expert_cache.baseline_policies import LFU, LRU, OnDemand
from moelight.expert_cache.cache_policy import CachePolicy
from moelight.expert_cache.combined_policy import Combined
from moelight.expert_cache.eam import EAMCollection
from moelight.expert_cache.learned_policies import CoServe, DuoServe, ProMoE
from moelight.expert_cache.moe_infinity_policy import MoEInfinity

POLICIES = ("on-demand", "lru", "lfu", "moe-infinity", "promoe", "duoserve", "coserve", "combined")
NEEDS_PREDICTOR = ("promoe", "duoserve", "coserve")  # `moelight train-predictor --kind NAME`
PREFETCHING = ("moe-infinity", "promoe", "duoserve", "combined")  # propose prefetches (`predicts`)
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
        if predictors is None or predictors.kind != name:
            raise ValueError(f"the {name} policy needs its predictor file (--predictor FILE from "
                             f"`moelight train-predictor --kind {name}`)")
        return {"promoe": ProMoE, "duoserve": DuoServe, "coserve": CoServe}[name](layers, experts, predictors)
    if name == "combined":
        return Combined(layers, experts, predictors)
    simple = {"on-demand": OnDemand, "lru": LRU, "lfu": LFU}
    if name not in simple:
        raise ValueError(f"unknown cache policy {name!r}; valid: {', '.join(POLICIES)}")
    return simple[name](layers, experts)
