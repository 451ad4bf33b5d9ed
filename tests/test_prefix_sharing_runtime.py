"""Prefix sharing through the device runtimes on the emulated device. CGOPipe, every schedule: CPU
attention through the block tables, GPU prefill attention over the prefixes uploaded from the CPU
cache, FlexGen's KV gathered through them. Latency mode: attention over the device's KV pages
through the block tables, each sample's expert record under its own key. The same tokens, logprobs
and prompt logprobs as the plain engine without sharing, with shared prefixes computed once. DeepSeek
too: its latent rows paged, a prompt's cached prefix expanded to K and V beside its new tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from moelight.engine.generation import Engine, GenerationStats
from moelight.expert_cache.cache_executor import ExpertCacheExecutor
from moelight.expert_cache.policy_registry import make_policy
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.sampling.params import SamplingParams
from tests.conftest import device_kinds
from tests.test_prefix_sharing import CFG, _prompts

EXEC_KW = dict(max_prefill_tokens=64, max_prompt_len=80, max_batch=8, max_context=128)


def _structured_model(cfg: ModelConfig):
    """Weights scaled up from the default initialisation so the logits have structure."""
    model = build_model(cfg, torch.float32, None, seed=3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model


def _window_sinks_config() -> ModelConfig:
    from moelight.loading.presets import preset_config

    cfg = preset_config("bench-gpt-oss")
    return ModelConfig(**{**cfg.__dict__, "num_layers": 2, "vocab_size": 512, "hidden_size": 64,
                          "intermediate_size": 64, "num_experts": 4, "top_k": 2, "sliding_window": 8,
                          "max_position_embeddings": 512})


def _deepseek_config() -> ModelConfig:
    from moelight.loading.hf_config import config_from_hf_dict
    from tests.test_deepseek_paths import KERNEL_SHAPE

    return config_from_hf_dict({**KERNEL_SHAPE, "vocab_size": 512})


def _family_config(family: str) -> ModelConfig:
    configs = {"mixtral": lambda: CFG, "gpt_oss-window-sinks": _window_sinks_config, "deepseek": _deepseek_config}
    return configs[family]()


def _generate(model, prompts, params, executor=None, share=True):
    stats = GenerationStats()
    engine = Engine(model, (2,), 64, executor=executor, prefix_sharing=share)
    out = engine.generate(prompts, params, list(range(len(prompts))), 6, 2, stats=stats)
    return out, stats


def _assert_same(got, ref, what, tol=1e-4):
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids, what
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < tol for t in x), what
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None and y is None) or all(abs(x[t].logprob - y[t].logprob) < tol for t in x), what


def _shares_as_the_plain_engine(model, executor, what, tol=1e-4):
    """The job through `executor` with sharing against the plain engine without: the same results."""
    prompts = _prompts()
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if k == 3 else None) for k in range(len(prompts))]
    ref, _ = _generate(model, prompts, params, share=False)
    try:
        got, stats = _generate(model, prompts, params, executor=executor)
    finally:
        executor.close()
    _assert_same(got, ref, what, tol)
    assert stats.prefix_reused_tokens > 0
    return stats, prompts


@pytest.mark.parametrize("budget", ["default", "a row a group"])
def test_the_plain_engine_shares_deepseeks_latent_prefixes(budget, monkeypatch):
    """The CPU engine over a paged latent cache: the paged latent decode kernel, prefixes expanded (all
    rows of a pass at once, or each alone as a small expansion budget makes it)."""
    from moelight.runtime import latent_kv_cache

    if budget != "default":
        monkeypatch.setattr(latent_kv_cache, "EXPAND_BUDGET", 1)
    model = _structured_model(_deepseek_config())
    prompts = _prompts()
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if k == 3 else None) for k in range(len(prompts))]
    ref, _ = _generate(model, prompts, params, share=False)
    got, stats = _generate(model, prompts, params)
    _assert_same(got, ref, "deepseek plain")
    assert stats.prefix_reused_tokens > 0
    assert stats.prefill_computed_tokens + stats.prefix_reused_tokens == sum(map(len, prompts))


# every schedule on Mixtral; GPT-OSS's windows and sinks and DeepSeek's latent rows on both attention
# placements: the CPU (cgopipe; flexgen-cpu and overlap-unpaged place it there too) and the device (flexgen)
PIPELINE_CASES = [(s, "mixtral") for s in SCHEDULES] + [
    (s, f) for f in ("gpt_oss-window-sinks", "deepseek") for s in ("cgopipe", "flexgen")]


@pytest.mark.parametrize("schedule,family", PIPELINE_CASES, ids=[f"{s}-{f}" for s, f in PIPELINE_CASES])
def test_the_pipeline_runtime_shares_prefixes_with_the_plain_engines_results(schedule, family):
    model = _structured_model(_family_config(family))
    ex = PipelineExecutor(model, schedule, "emulated", r_w=0.5, **EXEC_KW)
    stats, prompts = _shares_as_the_plain_engine(model, ex, f"{family} {schedule}")
    assert stats.prefill_computed_tokens + stats.prefix_reused_tokens == sum(map(len, prompts))


@pytest.mark.parametrize("device", device_kinds())
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss-window-sinks", "deepseek"])
@pytest.mark.parametrize("policy", ["lru", "combined"])
def test_latency_mode_shares_prefixes_with_the_plain_engines_results(policy, family, device):
    """On CUDA the device keeps its own copy of the KV pages (made inside a pass, an inference
    tensor): copy-on-write must update it too (logprobs there within cuBLAS rounding)."""
    cfg = _family_config(family)
    model = _structured_model(cfg)
    policy = make_policy(policy, sum(cfg.is_sparse(j) for j in range(cfg.num_layers)), cfg.num_experts)
    slots = max(2 * cfg.num_layers, cfg.num_experts)  # a prefill pass may need a layer's every expert
    if device == "cuda":
        ex = ExpertCacheExecutor(copy.deepcopy(model), slots, policy, "cuda", prefetch_per_layer=1)
    else:
        ex = ExpertCacheExecutor(model, slots, policy, "emulated", prefetch_per_layer=1,
                                 device_memory=256 << 20)
    _shares_as_the_plain_engine(model, ex, f"{family} latency {policy.name}", 1e-4 if device == "emulated" else 1e-3)


@pytest.mark.parametrize("family", ["mixtral", "deepseek"])
def test_long_prefixes_under_one_new_token_each_stay_within_the_plan(family):
    """60 prompts of 27 shared pages and one token more: a prefill chunk of 60 new tokens reads ~26k cached
    positions, far beyond its planned activations. CGOPipe uploads the prefixes in groups the memory plan
    counts (`prefix_tokens`), so the strict device's budget holds, and the tokens are the plain engine's."""
    import random

    model = _structured_model(_family_config(family))
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(432)]
    prompts = [system + [rng.randrange(3, 500)] for _ in range(64)]
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)] * len(prompts)
    ids = list(range(len(prompts)))
    ref = Engine(model, (2,), 64, prefix_sharing=False).generate(prompts, params, ids, 64, 64)
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, max_prefill_tokens=64, max_prompt_len=448,
                          max_batch=64, max_context=460)
    stats = GenerationStats()
    try:
        got = Engine(model, (2,), 64, executor=ex).generate(prompts, params, ids, 64, 64, stats=stats)
        assert ex.device.memory_peak <= ex.plan.total
    finally:
        ex.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert stats.prefix_reused_tokens >= 60 * 432
