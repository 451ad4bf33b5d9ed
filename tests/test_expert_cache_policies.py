"""The expert cache's pure parts against hand-worked cases: EAM distance and collection (MoE-Infinity
Eq. 1 and its K-means), the policies' priorities and eviction scores, the cache state machine's
hits, misses, evictions and prefetch budget, and the link queue's order."""

from __future__ import annotations

import numpy as np
import pytest

from moelight.expert_cache.baseline_policies import LFU, LRU, OnDemand
from moelight.expert_cache.cache_simulator import LinkQueue
from moelight.expert_cache.cache_state import CacheConfigError, CacheStats, ExpertCache, Fetch
from moelight.expert_cache.eam import EAMCollection, EAMError, eam_distances, eam_of
from moelight.expert_cache.moe_infinity_policy import EPSILON, MoEInfinity
from moelight.expert_cache.policy_registry import POLICIES, make_policy
from moelight.expert_cache.predictors import MLP, Predictors, RoutingProfile


def test_eam_distance_is_one_minus_mean_row_cosine():
    a = np.array([[2, 0, 0], [0, 1, 1]], float)
    b = np.array([[1, 0, 0], [0, 2, 0]], float)
    # row 0: same direction (1); row 1: (0,1,1)/sqrt2 . (0,1,0) = 0.7071
    assert eam_distances(a, b[None])[0] == pytest.approx(1 - (1 + 2**-0.5) / 2)
    assert eam_distances(a, b[None], rows=[0])[0] == pytest.approx(0.0)  # only the seen layer counts
    assert eam_distances(3 * a, a[None])[0] == pytest.approx(0.0)  # independent of sequence length


def test_eam_of_counts_tokens_and_skips_unrouted():
    experts = np.array([[[0, 1], [2, 0]], [[0, 2], [-1, -1]]])  # 2 tokens, 2 layers, top-2
    assert eam_of(experts, 3).tolist() == [[2, 1, 1], [1, 0, 1]]


def test_collection_keeps_one_member_near_each_cluster_centre(tmp_path):
    near_a = [np.array([[5, 1, 0], [0, 5, 1]]) + i * np.array([[0, 0, 1], [0, 0, 0]]) for i in range(3)]
    near_b = [np.array([[0, 1, 5], [5, 0, 1]]) + i * np.array([[1, 0, 0], [0, 0, 0]]) for i in range(3)]
    eams = np.stack([*near_a, *near_b]).astype(float)
    col = EAMCollection.build(eams, capacity=2, seed=0)
    assert len(col.eams) == 2
    kept = {tuple(map(tuple, e.astype(int))) for e in col.eams}
    # each kept EAM is its cluster's middle member (nearest the centroid)
    assert kept == {tuple(map(tuple, near_a[1])), tuple(map(tuple, near_b[1]))}
    assert np.array_equal(col.nearest(np.array([[4, 0, 0], [0, 0, 0]], float)), near_a[1])
    path = col.save(tmp_path / "c.npz")
    assert np.array_equal(EAMCollection.load(path, layers=2, experts=3).eams, col.eams)
    with pytest.raises(EAMError, match="EAMs of 2 MoE layers x 3 experts .* this model routes 4 x 3"):
        EAMCollection.load(path, layers=4, experts=3)
    (tmp_path / "bad.npz").write_text("nope")
    with pytest.raises(EAMError, match="not an EAM collection"):
        EAMCollection.load(tmp_path / "bad.npz")


def test_moe_infinity_prefetch_priority_by_hand():
    p_eam = np.array([[3, 1], [0, 4], [2, 2], [1, 3]], float)
    pol = MoEInfinity(4, 2, EAMCollection(p_eam[None]))
    pol.begin(7)
    pol.observe(0, {7: np.array([1, 0])})
    pol.observe(1, {7: np.array([0, 1])})
    prio = pol.prefetch(1).reshape(4, 2)
    want = np.array([[(0.75 + EPSILON) * 0.25, (0.25 + EPSILON) * 0.25],  # layer 0: 3 ahead (next token)
                     [0.0, 0.0],  # the current layer: not prefetched
                     [(0.5 + EPSILON) * 0.75, (0.5 + EPSILON) * 0.75],  # 1 ahead
                     [(0.25 + EPSILON) * 0.5, (0.75 + EPSILON) * 0.5]])  # 2 ahead
    assert prio == pytest.approx(want)


def test_moe_infinity_eviction_score_by_hand():
    pol = MoEInfinity(4, 2, EAMCollection(np.ones((1, 4, 2))))
    pol.begin(1)
    pol.observe(0, {1: np.array([2, 0])})
    pol.observe(1, {1: np.array([1, 1])})
    want = [1 + EPSILON, EPSILON, 0.5 + EPSILON, 0.5 + EPSILON]
    want = np.array(want + [0, 0, 0, 0], float)
    want[:4] *= [1, 1, 0.75, 0.75]
    want[4:] = [EPSILON * 0.5, EPSILON * 0.5, EPSILON * 0.25, EPSILON * 0.25]
    assert pol.scores(np.ones(8, bool)) == pytest.approx(want)
    pol.end(1)
    assert not pol.eams


def _counts(*experts, e=2):
    return {0: np.bincount(np.array(experts, int), minlength=e)}


def test_lru_cache_by_hand():
    c = ExpertCache(2, 2, 2, LRU(2, 2))
    needed, demand = c.access(0, _counts(0, 1))
    assert needed == [0, 1] and [(f.key, f.slot, f.demand) for f in demand] == [(0, 0, True), (1, 1, True)]
    _, demand = c.access(1, _counts(0))  # key 2: evicts the least recently used, key 0
    assert [(f.key, f.slot) for f in demand] == [(2, 0)] and c.evicted_now == [0]
    _, demand = c.access(0, _counts(1))  # key 1 still cached
    assert demand == [] and (c.stats.hits, c.stats.misses) == (1, 3)
    _, demand = c.access(0, _counts(0))  # key 0 again: evicts key 2 (used before key 1's hit)
    assert [(f.key, f.slot) for f in demand] == [(0, 0)] and c.evicted_now == [2]


def test_lfu_fifo_and_locking():
    lfu = ExpertCache(2, 2, 3, LFU(2, 2))
    lfu.access(0, _counts(0, 0, 0, 1))  # key 0 served 3 tokens, key 1 one
    lfu.access(1, {0: np.array([1, 0])})  # key 2 (one token)
    lfu.access(1, {0: np.array([0, 2])})  # key 3: evicts the least used unlocked: key 1 or 2 (1 token): key 1 older
    assert lfu.evicted_now == [1]
    fifo = ExpertCache(2, 2, 2, OnDemand(2, 2))
    fifo.access(0, _counts(0, 1))
    fifo.access(0, _counts(1))  # a hit does not refresh a FIFO entry
    fifo.access(1, _counts(0))
    assert fifo.evicted_now == [0]
    with pytest.raises(CacheConfigError, match="cannot hold one layer's 2 experts"):
        ExpertCache(2, 2, 1, LRU(2, 2))


def test_prefetch_budget_priority_and_waste():
    p_eam = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1]], float)
    pol = MoEInfinity(3, 3, EAMCollection(p_eam[None]))
    c = ExpertCache(3, 3, 4, pol, prefetch_per_layer=1)
    pol.begin(0)
    c.access(0, {0: np.array([1, 0, 0])})
    f = c.plan_prefetch(0)  # one per layer: layer 1's expert 1 (share 1, one layer ahead)
    assert [(x.key, x.demand) for x in f] == [(4, False)] and c.stats.prefetch_issued == 1
    c.access(1, {0: np.array([0, 1, 0])})  # the prefetched expert is used: a hit
    assert c.stats.prefetch_used == 1 and c.stats.hits == 1
    assert c.stats.prefetch_recall == pytest.approx(1 / (1 + 1))  # used / (used + misses)
    c.stats.prefetch_late = 1
    assert c.stats.good_pred == 0.0


@pytest.mark.parametrize("name", ["combined", "promoe", "duoserve", "moe-infinity"])
@pytest.mark.parametrize("given", [0, 2])
def test_a_given_prefetch_budget_wins_over_a_policys_own(name, given):
    """--prefetch-per-layer N is every policy's budget: combined's own 1 and the learned policies' "all
    predicted" yield to it, 0 included, and the report states the budget that ran."""
    rng = np.random.default_rng(5)
    L, E, h = 4, 8, 5
    eamc = EAMCollection(rng.integers(0, 5, (4, L, E)).astype(float))
    prof = RoutingProfile(rng.dirichlet(np.ones(E), L), rng.dirichlet(np.ones(E), (L - 1, E)))
    mlps = {j: MLP([(rng.normal(size=(h if name == "promoe" else L * E + 2 * E, E)), np.zeros(E))])
            for j in range(L - 1)}
    kind = name if name in ("promoe", "duoserve") else "coserve"
    preds = Predictors(kind, L, E, 2, h, prof, stride=2 if name == "promoe" else 1, mlps=mlps)
    cache = ExpertCache(L, E, 2 * E, make_policy(name, L, E, eamc, preds), prefetch_per_layer=given,
                        prefetch_given=True)
    assert cache.budget == given
    cache.policy.begin(0)
    for _ in range(40):
        j = int(rng.integers(L))
        cache.policy.observe_hidden(j, rng.normal(size=(2, h)))
        cache.access(j, {0: np.bincount(rng.choice(E, 4), minlength=E)})
        assert len(cache.plan_prefetch(j)) <= given
    assert cache.stats.prefetch_issued <= 40 * given


@pytest.mark.parametrize("name", POLICIES)
def test_the_cache_never_holds_more_than_its_slots(name):
    rng = np.random.default_rng(3)
    L, E, slots, h = 6, 8, 11, 5
    eamc = EAMCollection(rng.integers(0, 5, (4, L, E)).astype(float))
    prof = RoutingProfile(rng.dirichlet(np.ones(E), L), rng.dirichlet(np.ones(E), (L - 1, E)))
    mlps = {j: MLP([(rng.normal(size=(h if name == "promoe" else L * E + 2 * E, E)), np.zeros(E))])
            for j in range(L - 1)}
    kind = name if name in ("promoe", "duoserve", "coserve") else "coserve"
    preds = Predictors(kind, L, E, 2, h, prof, stride=2 if name == "promoe" else 1, mlps=mlps)
    cache = ExpertCache(L, E, slots, make_policy(name, L, E, eamc, preds), prefetch_per_layer=3, cpu_max_tokens=1)
    cache.policy.begin(0)
    for _ in range(200):
        j = int(rng.integers(L))
        cache.policy.observe_hidden(j, rng.normal(size=(2, h)))
        cache.access(j, {0: np.bincount(rng.choice(E, 2 * int(rng.integers(1, 4))), minlength=E)})
        cache.plan_prefetch(j)
        resident = np.flatnonzero(cache.slot_of >= 0)
        assert len(resident) <= slots
        assert sorted(cache.slot_of[resident]) == sorted(set(cache.slot_of[resident]))  # one expert per slot
        assert all(cache.key_of[cache.slot_of[k]] == k for k in resident)


def test_link_queue_puts_demands_first_and_finishes_a_copy_under_way():
    stats = CacheStats()
    q = LinkQueue(1.0, 100.0, stats)
    q.push(Fetch(10, 0, False, 0.9, 1), 0.0)
    q.push(Fetch(11, 1, False, 0.5, 2), 0.0)
    q.run_until(0.5)  # key 10 has started
    q.push(Fetch(12, 2, True, float("inf"), 3), 0.5)
    assert q.ready_at(12) == 2.0  # after key 10's copy (0-1), before key 11's
    assert q.ready_at(11) == 3.0
    q.push(Fetch(13, 3, False, 0.1, 4), 3.0)
    assert q.cancel(13) and not q.cancel(13)
    assert stats.fetched_bytes == 300.0
