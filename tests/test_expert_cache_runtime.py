"""Latency mode's runtime on the strict emulated device, on the committed trained checkpoint
(structured routing): the plain engine's greedy float32 tokens and every pass's logits with every
policy, memory as counted from the model, no more than one host sync per MoE layer pass (the
routing the cache decides from), the same hits as the trace simulator makes from the same routing;
and the faults the comparison catches (a slot filled with another expert, a dropped attention
output, compute that does not wait for its expert's copy)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from hrm import get_hardware, model_from_hf_config
from moelight.devices import race_check as race_check_module
from moelight.devices.device_base import StreamOrderError
from moelight.errors import NumericalError
from moelight.expert_cache import cache_executor
from moelight.expert_cache.cache_executor import ExpertCacheExecutor, non_expert_bytes
from moelight.expert_cache.cache_simulator import PassTimer, simulate_cache
from moelight.expert_cache.eam import EAMCollection, eam_of
from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, POLICIES, make_policy
from moelight.expert_cache.predictor_training import train_predictors
from moelight.jobs.trace_job import trace_requests
from moelight.loading.model_source import load_model, resolve_model
from moelight.pipeline.memory_plan import held_bytes_per_token, layer_pass_bytes_per_token, logits_bytes
from moelight.sampling.params import SamplingParams
from moelight.tokenization.tokenizer import load_tokenizer
from tests.conftest import device_kinds
from tests.runtime_check import assert_close_run_on_gpu, assert_same_run, run_job

CKPT = Path(__file__).parent / "data" / "stdlib-moe"  # benchmarks/train_small_moe.py --layers 4 --minutes 4
SNIPPETS = ["def __init__(self, name, value=None):\n    ", "import os\nimport sys\n\n\ndef main(", "class Error(",
            "    for i in range(len(items)):\n        ", "    \"\"\"Return the number of", "if __name__ == ",
            "    raise ValueError(f\"", "    with open(path) as f:\n        "]


def expert_bytes(model) -> int:
    """One routed expert's weights (gate, up and down) in the model's dtype, counted from its shape."""
    c = model.config
    return 3 * c.hidden_size * c.intermediate_size * model.embed_tokens.weight.element_size()


@pytest.fixture(scope="module")
def setup():
    src = resolve_model(str(CKPT), "auto", "float32")
    model = load_model(src)
    tok = load_tokenizer(CKPT, model_vocab_size=src.config.vocab_size)
    prompts = [tok.encode(s) for s in SNIPPETS]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) for _ in prompts]
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


def _executor(model, policy, slots, budget=2, h2d_bandwidth=4e9, device="emulated"):
    if device == "cuda":  # over a copy: the non-expert modules move to the GPU, the experts are pinned
        return ExpertCacheExecutor(copy.deepcopy(model), slots, policy, "cuda", prefetch_per_layer=budget,
                                   prefetch_given=True, cpu_max_tokens=cpu_tokens(model))
    return ExpertCacheExecutor(model, slots, policy, "emulated", prefetch_per_layer=budget, prefetch_given=True,
                               device_memory=64 << 20, cpu_max_tokens=cpu_tokens(model), h2d_bandwidth=h2d_bandwidth,
                               d2h_bandwidth=4e9)


def check_memory(ex, model, prompts, batch) -> None:
    """Weights and slots exactly as counted from the model; the peak above them within the engine's
    KV cache and what the passes allocate (the memory plan's bounds of a layer pass)."""
    c, dtype = model.config, model.embed_tokens.weight.dtype
    static = non_expert_bytes(model) + (ex.cache.slots + len(ex.stream_slots)) * expert_bytes(model)
    kv = sum(t.numel() * t.element_size() for t in (*ex._kv_src.k, *ex._kv_src.v))
    tokens = max(sum(sorted(map(len, prompts))[-batch:]), batch)
    passes = tokens * (held_bytes_per_token(c, dtype) + layer_pass_bytes_per_token(c, dtype, 1)) \
        + 6 * 4 * c.num_heads * max(map(len, prompts)) ** 2 + batch * logits_bytes(c, dtype)
    assert static + kv < ex.device.memory_peak <= static + kv + passes


def _run(model, prompts, params, policy, slots, batch, budget=2, device="emulated"):
    ex = _executor(model, policy, slots, budget, device=device)
    try:
        static = non_expert_bytes(model) + (slots + len(ex.stream_slots)) * expert_bytes(model)
        if device == "emulated":
            assert ex.device.memory_used == static
        run = run_job(ex.model, ex, prompts, params, batch, batch, max_prefill_tokens=256)
        if device == "emulated":
            check_memory(ex, model, prompts, batch)
        else:  # CUDA's allocator rounds blocks and adds workspaces: the weights and slots are a lower bound
            assert ex.device.memory_peak >= static
        stats = ex.stats()
        moe_layers = sum(model.config.is_sparse(j) for j in range(model.config.num_layers))
        hidden = 1 if policy.wants_hidden else 0  # ProMoE's predictors read each layer's input too
        on_cpu = 1 if policy.cpu_offload else 0  # CoServe: one read of the layer's input for all its CPU experts
        assert stats["gpu_lane_syncs_per_step"] <= (moe_layers * (1 + hidden + on_cpu) + 1) * -(-len(prompts) // batch)
        assert stats["pageable_copies"] == 0  # the experts were pinned once at load
        return run, ex.cache_stats
    finally:
        ex.close()


@pytest.fixture(scope="module")
def plain(setup):
    model, prompts, params, *_ = setup
    return {b: run_job(model, None, prompts, params, b, b, max_prefill_tokens=256) for b in (1, 3)}


SLOTS, BUDGET = 10, 3  # two slots beyond a layer's 8 experts, three prefetches a layer: evictions and prefetches
_RUNS: dict = {}


def policy_run(setup, name: str, batch: int):
    """The job on the emulated runtime with policy `name` (run once: its tokens and logits are checked
    against the plain engine's, its cache decisions against the simulator's)."""
    if (name, batch) not in _RUNS:
        model, prompts, params, L, E, eamc = setup
        _RUNS[name, batch] = _run(model, prompts, params, policy_of(name, L, E, eamc), slots=SLOTS, batch=batch,
                                  budget=BUDGET)
    return _RUNS[name, batch]


@pytest.mark.parametrize("device", device_kinds())
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_gives_the_plain_engines_tokens_and_logits(setup, plain, name, batch, device):
    model, prompts, params, L, E, eamc = setup
    if device == "emulated":
        run, stats = policy_run(setup, name, batch)
    else:
        run, stats = _run(model, prompts, params, policy_of(name, L, E, eamc), SLOTS, batch, BUDGET, device=device)
    if device == "emulated":
        assert_same_run(run, plain[batch], what=name)
    else:
        assert_close_run_on_gpu(run, plain[batch], what=name)
    assert stats.accesses == stats.hits + stats.misses > 0
    assert stats.fetched_bytes > 0 or stats.cpu_executed == stats.misses  # every miss fetched, or run on the CPU
    if name in ("moe-infinity", "promoe", "duoserve"):
        assert stats.prefetch_issued > 0
    if name == "duoserve":
        assert stats.streamed > 0  # its prefill bypasses the cache
    if name == "coserve":
        assert stats.cpu_executed > 0  # misses with few tokens ran on the CPU


def test_uploads_reuse_pooled_pinned_buffers(setup, plain):
    """Every upload (tokens, rotary tables, slots, CoServe's CPU experts' rows) goes through pinned
    buffers taken from a pool: a second job on the same executor page-locks no new memory."""
    model, prompts, params, L, E, eamc = setup
    ex = _executor(model, policy_of("coserve", L, E, eamc), 12)
    dev, calls = ex.device, {"upload": 0, "page-lock": 0}
    upload, pin, pinned = dev.upload, dev.pin, dev.pinned

    def counted(name, f):
        def call(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return call

    dev.upload, dev.pin, dev.pinned = counted("upload", upload), counted("page-lock", pin), counted("page-lock", pinned)
    try:
        run_job(model, ex, prompts, params, 3, 3, max_prefill_tokens=256)
        calls.update({"upload": 0, "page-lock": 0})
        again = run_job(model, ex, prompts, params, 3, 3, max_prefill_tokens=256)
        assert_same_run(again, plain[3])
        assert calls["upload"] > 20 and calls["page-lock"] == 0
        assert ex.stats()["pageable_copies"] == 0
    finally:
        ex.close()


@pytest.mark.parametrize("fault", ["a slot filled with another expert", "a dropped attention output",
                                   "compute not waiting for its copy"])
@pytest.mark.parametrize("race_check", [False, True])
def test_the_comparison_catches_a_cache_fault(setup, plain, fault, race_check, monkeypatch):
    """Wrong weights or a dropped output change the tokens; compute that does not wait for its expert's
    copy reads the copy's poison (NaN logits), or, with the race check, is refused at the read."""
    monkeypatch.setenv(race_check_module.ENV, "1" if race_check else "0")
    model, prompts, params, L, E, eamc = setup
    ex = _executor(model, policy_of("lru", L, E, eamc), 12, h2d_bandwidth=4e7) if "waiting" in fault else \
        _executor(model, policy_of("lru", L, E, eamc), 12)
    try:
        if fault == "a slot filled with another expert":
            chunks = ex._chunks

            def wrong(f):
                pairs = chunks(f)
                if f.key == 3:  # layer 0's expert 3 arrives holding expert 4's weights
                    mlp = model.layers[ex.moe_layers[0]].mlp
                    (dgu, _), (ddn, _) = pairs[0]
                    return [[(dgu, mlp.gate_up_proj[4].detach()), (ddn, mlp.down_proj[4].detach())]]
                return pairs

            ex._chunks = ex.worker.split = wrong
        elif fault == "a dropped attention output":
            attention, calls = cache_executor.batched_decode_attention, [0]

            def dropped(*args, **kwargs):
                calls[0] += 1
                out = attention(*args, **kwargs)
                return out * 0 if calls[0] == 2 else out

            monkeypatch.setattr(cache_executor, "batched_decode_attention", dropped)
        else:  # the slot still holds the copy's poison when the expert runs: NaN logits stop the job
            monkeypatch.setattr(ex.device, "wait_event", lambda event: None)
        expected = AssertionError
        if "waiting" in fault:
            expected = StreamOrderError if race_check else NumericalError
        with pytest.raises(expected):
            assert_same_run(run_job(model, ex, prompts, params, 3, 3, max_prefill_tokens=256), plain[3])
    finally:
        ex.close()


def test_the_race_check_catches_a_copy_into_a_slot_compute_still_reads(setup, monkeypatch):
    """A slot's next copy must wait for the compute that last read it (`used`: on a GPU that compute
    may still be queued). The emulated compute has always run by then, so only the race check sees it."""
    monkeypatch.setenv(race_check_module.ENV, "1")
    model, prompts, params, L, E, eamc = setup
    ex = _executor(model, policy_of("lru", L, E, eamc), SLOTS)
    monkeypatch.setattr(ex.worker, "used", lambda slots: None)
    try:
        with pytest.raises(RuntimeError, match=r"expert copy failed: StreamOrderError.*writes device memory that"):
            run_job(model, ex, prompts, params, 3, 3, max_prefill_tokens=256)
    finally:
        ex.close()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", POLICIES)
def test_the_simulator_makes_the_runtimes_decisions_from_the_same_routing(setup, name, batch):
    model, prompts, params, L, E, eamc = setup
    _, runtime = policy_run(setup, name, batch)
    trace = trace_requests(model, (2,), [str(i) for i in range(len(prompts))], prompts, params, [0] * len(prompts),
                           "stdlib-moe", hidden=True)
    spec = model_from_hf_config(model.config.to_hf_dict())
    sim = simulate_cache(trace, lambda: policy_of(name, L, E, eamc), SLOTS, get_hardware("t4"), spec, batch=batch,
                         prefetch_per_layer=BUDGET, dtype="float32").stats
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
