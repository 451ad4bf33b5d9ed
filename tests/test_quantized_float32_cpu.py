"""float32 with --quantize on the CPU engine is dequantize-then-float32-matmul (runtime/cpu_linear.py), as
the emulated pipeline computes it: the same greedy tokens and logprobs (the fused kernel, which computes
in bf16 with int8 activations on VNNI / AVX2 hosts, gave other tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from moelight import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 77, 130, 9, 41, 250, 17], [300, 12, 45], [8, 9, 10, 11, 12, 13, 14, 15, 16, 200, 201]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral")
    cfg = transformers.MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=1,
                                     eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(1)
    transformers.MixtralForCausalLM(cfg).save_pretrained(d)
    (d / "policy.json").write_text(json.dumps({"batch_size": 4, "micro_batch_size": 2, "num_micro_batches": 2,
                                               "attn_on_gpu": False, "ffn_on_gpu": True, "r_w": 0.5, "r_c": 0.0,
                                               "dtype": "float32"}))
    return d


def _run(folder, quantize: str, **kw):
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    out = LLM(str(folder), tokenizer="none", dtype="float32", quantize=quantize, **kw).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in out]
    logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in out]
    return tokens, logprobs


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_cpu_engine_float32_quantized_experts_match_the_emulated_pipeline(folder, quantize):
    cpu = _run(folder, quantize, device="cpu")
    emulated = _run(folder, quantize, device="emulated", policy=str(folder / "policy.json"), hardware="t4")
    assert cpu[0] == emulated[0]
    torch.testing.assert_close(torch.tensor(cpu[1]), torch.tensor(emulated[1]), rtol=0, atol=1e-5)



def test_the_memory_check_counts_the_float32_copy_the_cpu_engine_holds():
    """A float32 CPU run holds its quantized experts expanded: the check before loading counts them so
    (it counted their int4 bytes); bf16 holds them quantized."""
    from dataclasses import replace

    from moelight.loading.presets import preset_config
    from moelight.models.expert_format import ExpertFormat
    from moelight.planning.memory_check import parameter_count, weight_bytes

    cfg = preset_config("tiny")
    quantized = replace(cfg, expert_format=ExpertFormat("uint4", 32, zero=True))
    assert weight_bytes(quantized, torch.float32, on_cpu=True) >= parameter_count(cfg) * 4
    assert weight_bytes(quantized, torch.bfloat16, on_cpu=True) < parameter_count(cfg) * 2
