"""The CGOPipe runtime on the emulated device: the plain engine's tokens, within budget."""

from __future__ import annotations

import random

import pytest
import torch

from moelight.devices.device_base import DeviceOutOfMemory
from moelight.engine.generation import Engine, GenerationStats
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.sampling.params import SamplingParams

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    num_experts=4,
    top_k=2,
    head_dim=16,
    max_position_embeddings=512,
)
EXEC_KW = dict(
    max_prefill_tokens=32,
    max_prompt_len=16,
    max_batch=8,
    max_context=64,
    h2d_bandwidth=2e9,
    d2h_bandwidth=2e9,
)


@pytest.fixture(scope="module")
def setup():
    model = build_model(CFG, torch.float32, None, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 14))] for _ in range(9)]
    # unequal lengths: some sequences finish early, so micro-batches shrink and vanish
    params = [SamplingParams(max_tokens=3 + (k % 4) * 2, ignore_eos=True) for k in range(len(prompts))]
    ref = Engine(model, (2,), max_prefill_tokens=32).generate(
        prompts, params, [0] * 9, batch_size=9, micro_batch_size=2
    )
    return model, prompts, params, [r.token_ids for r in ref]


@pytest.mark.parametrize("r_w", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tokens_match_plain_engine_within_budget(setup, schedule, r_w):
    model, prompts, params, ref = setup
    ex = PipelineExecutor(model, schedule, "emulated", r_w=r_w, **EXEC_KW)
    try:
        out = Engine(model, (2,), max_prefill_tokens=32, executor=ex).generate(
            prompts, params, [0] * 9, batch_size=9, micro_batch_size=2
        )
        assert [r.token_ids for r in out] == ref
        assert ex.device.memory_peak <= ex.device.memory_capacity == ex.plan.total
        assert ex.pager.n_resident == round(r_w * CFG.num_experts)
        graph, events = ex.last_pass
        assert graph.name == schedule and all(e.done and e.error is None for e in events)
        if r_w < 1:
            assert graph.find("w_h2d")  # the paged experts really moved
    finally:
        ex.close()


def test_two_batches_and_the_carried_weight_slot(setup):
    """Layer 0's pages are prefetched by each pass for the next one, across batches."""
    model, prompts, params, _ = setup
    ref = Engine(model, (2,), max_prefill_tokens=32).generate(
        prompts, params, [0] * 9, batch_size=4, micro_batch_size=3
    )
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.25, **EXEC_KW)
    try:
        out = Engine(model, (2,), max_prefill_tokens=32, executor=ex).generate(
            prompts, params, [0] * 9, batch_size=4, micro_batch_size=3
        )
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
        assert ex.first_loaded
    finally:
        ex.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_refilled_batches_on_every_schedule(setup, schedule):
    """Finished sequences' slots refilled mid-run (prefill between decode steps) on the runtime."""
    model, prompts, params, ref = setup
    ex = PipelineExecutor(model, schedule, "emulated", r_w=0.5, **EXEC_KW)
    try:
        stats = GenerationStats()
        out = Engine(model, (2,), max_prefill_tokens=32, executor=ex, refill=True).generate(
            prompts, params, [0] * 9, batch_size=4, micro_batch_size=2, stats=stats
        )
        assert [r.token_ids for r in out] == ref
        assert len(stats.batches) > 3  # more prefill waves than the 3 static batches of 4
        assert ex.device.memory_peak <= ex.device.memory_capacity
    finally:
        ex.close()


def test_budget_too_small_raises(setup):
    model, prompts, params, _ = setup
    probe = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.0, **EXEC_KW)
    static = probe.device.memory_used  # weights + slots
    probe.close()
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.0, device_memory=static + 256, **EXEC_KW)
    try:
        with pytest.raises(DeviceOutOfMemory):
            Engine(model, (2,), executor=ex).generate(
                prompts[:2], params[:2], [0, 0], batch_size=2, micro_batch_size=1
            )
        assert ex.device.memory_peak <= ex.device.memory_capacity
    finally:
        ex.close()
    with pytest.raises(DeviceOutOfMemory):  # the resident weights alone do not fit
        PipelineExecutor(model, "cgopipe", "emulated", r_w=1.0, device_memory=static, **EXEC_KW)
