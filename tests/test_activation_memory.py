"""The HRM's activation bytes per prefill token against what the runtime holds on the strict emulated
device (every tensor counted): measured as the growth of the device's peak between two prefill pass
sizes, for a plain SwiGLU family, a many-expert one (k = 8: the weighting phase binds), GPT-OSS's
clamped SwiGLU with biases and DeepSeek-V3's latent attention (whose routed rows bind as in the others).
The planner sizes a policy's device memory with it, so it must not fall short of the runtime (a plan
that fits on paper runs out mid-job) nor far exceed it."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from hrm.operators import activation_bytes_per_token
from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.presets import PRESETS
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.planning.held_model import held_model_spec
from moelight.sampling.params import SamplingParams
from tests.runtime_check import run_job
from tests.tp_helpers import random_model

pytestmark = pytest.mark.no_race_check  # activation memory; ordering: the runtimes' own tests

SMALL = dict(num_layers=2, vocab_size=512, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
FAMILIES = {
    "mixtral": replace(PRESETS["bench-1b"], intermediate_size=512, **SMALL),
    "qwen3_moe": replace(PRESETS["bench-qwen3-moe"], intermediate_size=64, num_experts=32, **SMALL),
    "gpt_oss": replace(PRESETS["bench-gpt-oss"], intermediate_size=256, num_experts=8, **SMALL),
    "deepseek_v3": config_from_hf_dict({  # MLA with a low-rank query, sigmoid group routing, a shared expert
        "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 8, "intermediate_size": 512, "moe_intermediate_size": 128, "kv_lora_rank": 64,
        "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 4096, "rope_theta": 1e6,
        "num_nextn_predict_layers": 0, "bos_token_id": 1, "eos_token_id": 2}),
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
    assert 0.9 * measured <= predicted <= 1.4 * measured, (family, r_w, measured, predicted)


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
