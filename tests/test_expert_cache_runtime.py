"""Latency mode's runtime on the emulated device, on the committed trained checkpoint (structured
routing): the plain engine's greedy float32 tokens with every policy, within the device budget,
and the same hits as the trace simulator makes from the same routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hrm import get_hardware, model_from_hf_config
from moelight.engine.generation import Engine
from moelight.expert_cache.cache_executor import ExpertCacheExecutor
from moelight.expert_cache.cache_simulator import PassTimer, simulate_cache
from moelight.expert_cache.eam import EAMCollection, eam_of
from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, POLICIES, make_policy
from moelight.expert_cache.predictor_training import train_predictors
from moelight.jobs.trace_job import trace_requests
from moelight.loading.model_source import load_model, resolve_model
from moelight.sampling.params import SamplingParams
from moelight.tokenization.tokenizer import load_tokenizer

CKPT = Path(__file__).parent / "data" / "stdlib-moe"  # benchmarks/train_small_moe.py --layers 4 --minutes 4
SNIPPETS = ["def __init__(self, name, value=None):\n    ", "import os\nimport sys\n\n\ndef main(", "class Error(",
            "    for i in range(len(items)):\n        ", "    \"\"\"Return the number of", "if __name__ == ",
            "    raise ValueError(f\"", "    with open(path) as f:\n        "]


@pytest.fixture(scope="module")
def setup():
    src = resolve_model(str(CKPT), "auto", "float32")
    model = load_model(src)
    tok = load_tokenizer(CKPT, model_vocab_size=src.config.vocab_size)
    prompts = [tok.encode(s) for s in SNIPPETS]
    params = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in prompts]
    L, E = src.config.num_layers, src.config.num_experts
    held = [tok.encode(s + " x = 1\n") for s in reversed(SNIPPETS)]  # the collection's and predictors' prompts
    t = trace_requests(model, (2,), [f"h{i}" for i in range(len(held))], held, params, [0] * len(held), "stdlib-moe",
                       hidden=True)
    eamc = EAMCollection.build(np.stack([eam_of(r.experts, E) for r in t.requests]), capacity=4)
    preds = {k: train_predictors(t, k, epochs=3) for k in NEEDS_PREDICTOR}
    return model, prompts, params, L, E, (eamc, preds)


def policy_of(name, L, E, known):
    eamc, preds = known
    return make_policy(name, L, E, eamc, preds.get(name))


def cpu_tokens(model) -> int:
    """The K*n + B crossover CoServe's runtime and simulator both take from the HRM (a T4 host)."""
    return PassTimer(get_hardware("t4"), model_from_hf_config(model.config.to_hf_dict()), "float32").cpu_crossover()


def _run(model, prompts, params, policy, slots, batch, budget=2):
    ex = ExpertCacheExecutor(model, slots, policy, "emulated", prefetch_per_layer=budget, device_memory=64 << 20,
                             cpu_max_tokens=cpu_tokens(model), h2d_bandwidth=4e9, d2h_bandwidth=4e9)
    try:
        out = Engine(model, (2,), 256, executor=ex).generate(prompts, params, [0] * len(prompts), batch, batch)
        assert ex.device.memory_peak <= ex.device.memory_capacity
        return [r.token_ids for r in out], ex.cache_stats
    finally:
        ex.close()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_gives_the_plain_engines_tokens(setup, name, batch):
    model, prompts, params, L, E, eamc = setup
    ref = [r.token_ids for r in Engine(model, (2,), 256).generate(prompts, params, [0] * len(prompts), batch, batch)]
    tokens, stats = _run(model, prompts, params, policy_of(name, L, E, eamc), slots=12, batch=batch)
    assert tokens == ref
    assert stats.accesses == stats.hits + stats.misses > 0
    assert stats.fetched_bytes > 0 or stats.cpu_executed == stats.misses  # every miss fetched, or run on the CPU
    if name in ("moe-infinity", "promoe", "duoserve"):
        assert stats.prefetch_issued > 0
    if name == "duoserve":
        assert stats.streamed > 0  # its prefill bypasses the cache
    if name == "coserve":
        assert stats.cpu_executed > 0  # misses with few tokens ran on the CPU


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", POLICIES)
def test_the_simulator_makes_the_runtimes_decisions_from_the_same_routing(setup, name, batch):
    model, prompts, params, L, E, eamc = setup
    _, runtime = _run(model, prompts, params, policy_of(name, L, E, eamc), slots=10, batch=batch, budget=3)
    trace = trace_requests(model, (2,), [str(i) for i in range(len(prompts))], prompts, params, [0] * len(prompts),
                           "stdlib-moe", hidden=True)
    spec = model_from_hf_config(model.config.to_hf_dict())
    sim = simulate_cache(trace, lambda: policy_of(name, L, E, eamc), 10, get_hardware("t4"), spec, batch=batch,
                         prefetch_per_layer=3, dtype="float32").stats
    for field in ("accesses", "hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_wasted",
                  "cpu_executed", "streamed"):
        assert getattr(sim, field) == getattr(runtime, field), field


def test_a_cache_smaller_than_a_layer_is_refused(setup):
    from moelight.expert_cache.cache_state import CacheConfigError

    model, _, _, L, E, _ = setup
    with pytest.raises(CacheConfigError, match="cannot hold one layer's 8 experts"):
        ExpertCacheExecutor(model, 7, make_policy("lru", L, E), "emulated")


def test_the_checkpoint_routes_as_a_trained_model_does():
    """The committed checkpoint's routing is skewed (not uniform), as the caches need to be tested on."""
    import json

    report = json.loads((CKPT / "training_report.json").read_text())
    trained = [x["top2_share"] for x in report["trained"]["layers"]]
    rand = [x["top2_share"] for x in report["random_weights"]["layers"]]
    assert report["trained"]["held_out_loss"] < report["random_weights"]["held_out_loss"] - 1.0
    assert np.mean(trained) > np.mean(rand)
