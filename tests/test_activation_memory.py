"""The HRM's activation bytes per prefill token against what the runtime holds on the strict emulated
device (every tensor counted): measured as the growth of the device's peak between two prefill pass
sizes, for a plain SwiGLU family, a many-expert one (k = 8: the weighting phase binds) and GPT-OSS's
clamped SwiGLU with biases. The planner sizes a policy's device memory with it, so it must not fall
short of the runtime (a plan that fits on paper runs out mid-job) nor far exceed it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hrm.operators import activation_bytes_per_token
from moelight.loading.presets import PRESETS
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.planning.held_model import held_model_spec
from moelight.sampling.params import SamplingParams
from tests.runtime_check import run_job
from tests.tp_helpers import random_model

SMALL = dict(num_layers=2, vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
FAMILIES = {
    "mixtral": replace(PRESETS["bench-1b"], intermediate_size=512, **SMALL),
    "qwen3_moe": replace(PRESETS["bench-qwen3-moe"], intermediate_size=64, num_experts=32, **SMALL),
    "gpt_oss": replace(PRESETS["bench-gpt-oss"], intermediate_size=256, num_experts=8, **SMALL),
}
PROMPT = 32


def device_peak(model, tokens: int, r_w: float) -> int:
    """The emulated device's peak over one prefill pass of `tokens` prompt tokens."""
    rows = tokens // PROMPT
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=r_w, device_memory=1 << 34, max_prefill_tokens=tokens,
                          max_prompt_len=PROMPT, max_batch=rows, max_sequences=rows, max_context=PROMPT + 2,
                          h2d_bandwidth=1e12, d2h_bandwidth=1e12)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(rows)]
    params = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True) for _ in prompts]
    try:
        run_job(model, ex, prompts, params, rows, rows, max_prefill_tokens=tokens)
        return ex.device.memory_peak
    finally:
        ex.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("r_w", [0.0, 0.5])
def test_the_hrm_counts_a_prefill_token_s_activations_as_the_runtime_holds_them(family, r_w):
    cfg = FAMILIES[family]
    model = random_model(cfg).to(torch.bfloat16)
    small, large = 128, 512
    measured = (device_peak(model, large, r_w) - device_peak(model, small, r_w)) / (large - small)
    predicted = activation_bytes_per_token(held_model_spec(cfg), 2)
    assert 0.9 * measured <= predicted <= 1.35 * measured, (family, r_w, measured, predicted)


def test_a_pass_past_the_expert_chunk_adds_only_its_tokens_own_tensors(monkeypatch):
    """Beyond EXPERT_CHUNK_TOKENS the runtime holds one chunk's routed rows, so a longer pass grows by
    the tokens' own tensors alone, as pass_activation_bytes counts it."""
    from hrm import operators
    from moelight.models import grouped_experts

    monkeypatch.setattr(grouped_experts, "EXPERT_CHUNK_TOKENS", 128)
    monkeypatch.setattr(operators, "EXPERT_CHUNK_TOKENS", 128)
    cfg = FAMILIES["mixtral"]
    model = random_model(cfg).to(torch.bfloat16)
    spec = held_model_spec(cfg)
    measured = (device_peak(model, 1024, 0.0) - device_peak(model, 256, 0.0)) / (1024 - 256)
    assert measured < 0.5 * activation_bytes_per_token(spec, 2)  # the routed rows stopped growing
    predicted = (operators.pass_activation_bytes(spec, 2, 1024) - operators.pass_activation_bytes(spec, 2, 256)) / 768
    assert 0.9 * measured <= predicted <= 1.5 * measured, (measured, predicted)
