"""DeepSeek (MLA) through every execution path: the plain CPU engine with the C++ latent kernel against
transformers, then CGOPipe on the emulated device (every schedule, paged and resident experts) and
latency mode's expert cache, each giving the plain engine's greedy float32 tokens; absorbed decode
against the expanded attention it replaces; the latent cache's size."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from moelight.engine.generation import Engine
from moelight.expert_cache.cache_executor import ExpertCacheExecutor
from moelight.expert_cache.policy_registry import make_policy
from moelight.loading.hf_config import config_from_hf_dict
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.runtime.latent_kv_cache import LatentKVCache, kv_cache_class
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts
from tests.conftest import device_kinds
from tests.runtime_check import assert_close_run_on_gpu, run_job
from tests.tp_helpers import random_model

# kv_lora_rank 64 + RoPE 32: a row width the C++ latent kernel is built for (cpu_kernels.latent.LATENT_SHAPES)
KERNEL_SHAPE = {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3,
                "num_attention_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 16,
                "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 32, "v_head_dim": 16,
                "q_lora_rank": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                "first_k_dense_replace": 1, "n_shared_experts": 1, "routed_scaling_factor": 2.0,
                "max_position_embeddings": 256, "rope_theta": 1e4, "num_nextn_predict_layers": 0,
                "bos_token_id": 1, "eos_token_id": 2}
PROMPTS = random_prompts(9, 300, min_len=2, max_len=14, seed=5)
PARAMS = [SamplingParams(max_tokens=3 + (k % 4) * 2, ignore_eos=True) for k in range(len(PROMPTS))]
EXEC_KW = dict(max_prefill_tokens=48, max_prompt_len=16, max_batch=8, max_context=64, h2d_bandwidth=4e9,
               d2h_bandwidth=4e9)


def tokens(model, executor=None) -> list[list[int]]:
    out = Engine(model, (2,), max_prefill_tokens=48, executor=executor).generate(
        PROMPTS, PARAMS, [0] * len(PROMPTS), batch_size=6, micro_batch_size=2)
    return [r.token_ids for r in out]


@pytest.fixture(scope="module")
def plain():
    model = random_model(config_from_hf_dict(KERNEL_SHAPE), seed=2)
    return model, tokens(model)


def test_plain_engine_with_the_latent_kernel_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    from moelight import LLM
    from tests.test_deepseek_checkpoints import hf_model

    hf = hf_model(**{k: v for k, v in KERNEL_SHAPE.items() if k != "model_type"})
    hf.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    llm = LLM(str(tmp_path / "m"), dtype="float32", batch_size=4, micro_batch_size=2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], greedy)]
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
                  for p in PROMPTS[:4]]
    assert ours == theirs


def _check(model, ref, ex, device: str, what: str) -> None:
    """The plain engine's tokens on the emulated device; on CUDA its logits within cuBLAS rounding."""
    if device == "emulated":
        assert tokens(model, ex) == ref
    else:
        got = run_job(ex.model, ex, PROMPTS, PARAMS, 6, 2, max_prefill_tokens=48)
        assert_close_run_on_gpu(got, run_job(model, None, PROMPTS, PARAMS, 6, 2, max_prefill_tokens=48), what=what)


@pytest.mark.parametrize("device", device_kinds())
@pytest.mark.parametrize("r_w", [0.0, 0.5])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cgopipe_on_the_device_gives_the_plain_tokens(plain, schedule, r_w, device):
    """CPU attention over the latent cache (cgopipe, flexgen-cpu, overlap-unpaged) and FlexGen's GPU
    attention over latent rows fetched to the device: the absorbed query and W_UV run on the device."""
    model, ref = plain
    if device == "cuda":  # over a copy: its non-expert modules move to the GPU
        kw = {k: v for k, v in EXEC_KW.items() if not k.endswith("bandwidth")}
        ex = PipelineExecutor(copy.deepcopy(model), schedule, "cuda", r_w=r_w, **kw)
    else:
        ex = PipelineExecutor(model, schedule, "emulated", r_w=r_w, **EXEC_KW)
    try:
        _check(model, ref, ex, device, f"{schedule} r_w={r_w}")
        assert ex.pager.sparse == [False, True, True]  # the dense first layer pages nothing
    finally:
        ex.close()


@pytest.mark.parametrize("device", device_kinds())
@pytest.mark.parametrize("policy", ["lru", "combined"])
def test_latency_mode_gives_the_plain_tokens(plain, policy, device):
    model, ref = plain
    cfg = model.config
    layers = sum(cfg.is_sparse(j) for j in range(cfg.num_layers))
    pol = make_policy(policy, layers, cfg.num_experts)
    if device == "cuda":
        ex = ExpertCacheExecutor(copy.deepcopy(model), 10, pol, "cuda", cpu_max_tokens=2)
    else:
        ex = ExpertCacheExecutor(model, 10, pol, "emulated", device_memory=64 << 20, cpu_max_tokens=2,
                                 h2d_bandwidth=4e9, d2h_bandwidth=4e9)
    try:
        _check(model, ref, ex, device, f"latency {policy}")
        assert ex.cache_stats.misses > 0
    finally:
        ex.close()


def test_absorbed_decode_is_the_expanded_attention(plain):
    """q W_UK over the latent rows, then W_UV: the expanded per-head attention, for a query at the end
    of a context (float64 to compare the algebra, not the rounding)."""
    model, _ = plain
    layer = model.layers[1].double()
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(7, 64, generator=g, dtype=torch.float64)
        cos, sin = (t.double() for t in model.rotary(torch.arange(7), torch.float32))
        q_full, (rows,) = layer.attention_inputs(x, cos, sin)
        q_abs, _ = layer.attention_inputs(x[-1:], cos[-1:], sin[-1:], decode=True)
        k, v = layer.prefill_kv(rows)
        scale = model.config.attention_scale
        expanded = torch.softmax(torch.einsum("hd,thd->ht", q_full[-1], k) * scale, -1)
        expanded = torch.einsum("ht,thd->hd", expanded, v).reshape(1, -1)
        p = torch.softmax(q_abs[0] @ rows[:, 0].T * scale, -1)  # [H, T] over the cached rows
        absorbed = layer.decode_output((p @ rows[:, 0, :64]).reshape(1, -1))
        torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-12)
    finally:
        layer.float()


def test_the_latent_cache_keeps_a_row_per_token():
    """DeepSeek-V3's 512 + 64 per token and layer: 1,152 B in bf16 against Mixtral's 4,096 B."""
    from moelight.loading.presets import preset_config
    from moelight.planning.memory_check import kv_bytes

    v3, mixtral = preset_config("deepseek-v3"), preset_config("mixtral-8x7b")
    assert kv_cache_class(v3) is LatentKVCache
    assert kv_bytes(v3, 1, torch.bfloat16) == v3.num_layers * 1152
    assert kv_bytes(mixtral, 1, torch.bfloat16) == mixtral.num_layers * 4096
    assert LatentKVCache.bytes_needed(v3, 10, torch.bfloat16) == kv_bytes(v3, 10, torch.bfloat16)
    small = config_from_hf_dict(KERNEL_SHAPE)
    cache = LatentKVCache.allocate(small, [3, 5], torch.float32)
    assert [t.shape for t in cache.kv] == [(1, 8, 96)] * 3 and cache.offsets.tolist() == [0, 3]


def test_prefix_expansion_groups_rows_within_the_budget():
    from moelight.runtime.paged_layout import row_groups

    assert row_groups([5, 5, 5, 20, 1], 10) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # 20 > 10 goes alone
    assert row_groups([3, 3], 100) == [(0, 2)] and row_groups([], 4) == []
