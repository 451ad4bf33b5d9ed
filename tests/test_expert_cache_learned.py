"""ProMoE's, DuoServe's and CoServe's predictors and policies against hand-worked cases, their
training on a trace whose routing is learnable, and the errors of a predictor file that does not
fit the model or the policy."""

from __future__ import annotations

import numpy as np
import pytest

from moelight.expert_cache.cache_state import ExpertCache
from moelight.expert_cache.learned_policies import CoServe, DuoServe, ProMoE
from moelight.expert_cache.predictor_training import train_predictors
from moelight.expert_cache.predictors import MLP, PredictorError, Predictors, RoutingProfile, duoserve_features
from moelight.expert_cache.routing_trace import RequestTrace, Trace, TraceModel


def _trace(experts: np.ndarray, hidden: np.ndarray | None = None, prompt: int = 1) -> Trace:
    L = experts.shape[1]
    return Trace(TraceModel("t", L, 4, experts.shape[2], 3, list(range(L))),
                 [RequestTrace("r", prompt, experts, np.full(experts.shape, 0.5, np.float32), hidden)])


def test_profile_popularity_and_affinity_by_hand():
    # 2 tokens, 2 layers, top-1: token 0 goes 0 -> 1, token 1 goes 0 -> 2
    t = _trace(np.array([[[0], [1]], [[0], [2]]]))
    prof = RoutingProfile.from_trace(t)
    assert prof.popularity.tolist() == [[1, 0, 0, 0], [0, 0.5, 0.5, 0]]
    assert prof.affinity[0, 0].tolist() == [0, 0.5, 0.5, 0]  # P(next | expert 0 here)
    assert prof.affinity[0, 3].tolist() == [0, 0, 0, 0]  # never seen


def _identity_mlp(E: int, scale: float = 10.0) -> MLP:
    """One layer whose logits are `scale` x the input's first E features: the predictor names them."""
    return MLP([(np.eye(E) * scale, np.full(E, -scale / 2))])


def test_promoe_prefetches_the_predicted_experts_two_layers_ahead():
    prof = RoutingProfile(np.full((4, 4), 0.25), np.full((3, 4, 4), 0.25))
    pred = Predictors("promoe", 4, 4, 2, 4, prof, stride=2, mlps={0: _identity_mlp(4), 1: _identity_mlp(4)})
    pol = ProMoE(4, 4, pred)
    pol.observe_hidden(0, np.array([[1.0, 0.0, 1.0, 0.0]]))  # names experts 0 and 2 of layer 2
    prio = pol.prefetch(0).reshape(4, 4)
    assert prio[2, [0, 2]] == pytest.approx([1 / (1 + np.exp(-5))] * 2)
    assert prio[[0, 1, 3]].sum() == 0 and prio[2, [1, 3]].sum() == 0
    pol.observe_hidden(2, np.ones((1, 4)))  # layer 2 + 2 is past the last layer: nothing to prefetch
    assert pol.prefetch(2) is None
    # in the cache: a per-layer LRU (each layer keeps its share), three-chunk copies, reordered compute
    assert (pol.per_layer, pol.copy_chunks, pol.reorder) == (True, 3, True)


def test_per_layer_partition_evicts_within_the_layer_that_holds_its_share():
    prof = RoutingProfile(np.full((2, 4), 0.25), np.full((1, 4, 4), 0.25))
    cache = ExpertCache(2, 4, 6, ProMoE(2, 4, Predictors("promoe", 2, 4, 2, 4, prof)))  # quota 3 per layer
    cache.access(0, {0: np.array([1, 1, 1, 0])})  # layer 0 fills its 3
    cache.access(1, {0: np.array([1, 1, 1, 0])})  # layer 1 its 3: the cache is full
    cache.access(0, {0: np.array([0, 0, 0, 1])})  # a 4th for layer 0 evicts from layer 0, not layer 1
    assert all(k < 4 for k in cache.evicted_now)


def test_duoserve_features_and_next_layer_prediction():
    prof = RoutingProfile(np.array([[0.5, 0.5, 0, 0], [0, 0, 0.7, 0.3]]), np.zeros((1, 4, 4)))
    prof.affinity[0, 1] = [0, 0, 0, 1.0]
    path = np.zeros((2, 4))
    path[0, 1] = 1
    f = duoserve_features(path, 0, path[0], prof)
    assert f.tolist() == [0, 1, 0, 0, 0, 0, 0, 0] + [0, 0, 0.7, 0.3] + [0, 0, 0, 1.0]
    # an MLP that follows the affinity part of the features names expert 3 of layer 1
    w = np.zeros((16, 4))
    w[12:, :] = np.eye(4) * 10
    pol = DuoServe(2, 4, Predictors("duoserve", 2, 4, 1, 4, prof, mlps={0: MLP([(w, np.full(4, -5.0))])}))
    pol.begin(0)
    pol.observe(0, {0: np.array([0, 1, 0, 0])})
    prio = pol.prefetch(0).reshape(2, 4)
    assert np.argmax(prio[1]) == 3 and prio[0].sum() == 0 and pol.stream_prefill


def test_coserve_evicts_experts_whose_predecessors_are_gone_first_then_the_least_used():
    pop = np.array([[0.5, 0.5], [0.9, 0.1]])
    aff = np.array([[[1.0, 0.0], [0.0, 1.0]]])  # expert i of layer 0 leads to expert i of layer 1
    pol = CoServe(2, 2, Predictors("coserve", 2, 2, 1, 4, RoutingProfile(pop, aff)))
    resident = np.array([False, True, True, True])  # layer 0: only expert 1; layer 1: both
    s = pol.scores(resident)
    # layer 1 expert 0 (usage 0.9) lost its predecessor: it goes before layer 1 expert 1 (usage 0.1)
    assert s[2] < s[3] and s[2] < s[1]
    assert pol.cpu_offload


def test_training_learns_a_learnable_routing_and_reports_held_out_accuracy():
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(30):  # layer 2's expert is the hidden state's argmax at layer 0
        h = rng.normal(size=(12, 3, 3)).astype(np.float32)
        ex = rng.integers(0, 3, size=(12, 3, 1))
        ex[:, 2, 0] = np.argmax(h[:, 0], axis=1)
        reqs.append(RequestTrace(f"r{i}", 1, ex, np.ones(ex.shape, np.float32), h))
    t = Trace(TraceModel("t", 3, 3, 1, 3, [0, 1, 2]), reqs)
    pred = train_predictors(t, "promoe", stride=2, epochs=40)
    assert set(pred.mlps) == {0} and pred.accuracy > 0.9
    duo = train_predictors(t, "duoserve", epochs=2)
    assert set(duo.mlps) == {0, 1} and 0 <= duo.accuracy <= 1
    assert not train_predictors(t, "coserve").mlps


def test_a_predictor_file_must_fit_the_model_and_the_policy(tmp_path):
    prof = RoutingProfile(np.full((2, 4), 0.25), np.full((1, 4, 4), 0.25))
    path = Predictors("promoe", 2, 4, 2, 16, prof, mlps={0: _identity_mlp(4)}, model="m").save(tmp_path / "p.npz")
    assert Predictors.load(path, "promoe", 2, 4, 16).mlps[0].layers[0][0].shape == (4, 4)
    with pytest.raises(PredictorError, match="trained for 2 MoE layers x 4 experts .* this model routes 32 x 8"):
        Predictors.load(path, "promoe", 32, 8, 16)
    with pytest.raises(PredictorError, match="a promoe predictor; the duoserve policy needs"):
        Predictors.load(path, "duoserve", 2, 4)
    with pytest.raises(PredictorError, match="hidden 16"):
        Predictors.load(path, "promoe", 2, 4, 4096)
    (tmp_path / "bad.npz").write_text("x")
    with pytest.raises(PredictorError, match="not a predictor file"):
        Predictors.load(tmp_path / "bad.npz", "promoe", 2, 4)


def test_a_file_that_is_no_npz_is_named_without_numpys_pickle_advice(tmp_path):
    """numpy reads a non-zip file as a pickle and suggests allow_pickle=: wrong advice for a file that is
    simply not ours; the error says what the file should be and how to make one."""
    from moelight.expert_cache.eam import EAMCollection, EAMError

    text = tmp_path / "text.npz"
    text.write_text("hello\n")
    with pytest.raises(EAMError) as eam:
        EAMCollection.load(text)
    with pytest.raises(PredictorError) as pred:
        Predictors.load(text, "promoe", 2, 4)
    for error, how in ((eam, "moelight eamc --trace"), (pred, "moelight train-predictor --trace")):
        assert "pickle" not in str(error.value) and how in str(error.value), error.value
