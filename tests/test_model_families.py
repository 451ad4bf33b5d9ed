"""Every family in the registry against transformers' own class on small random checkpoints:
greedy float32 tokens identical, prefill logits within rtol 1e-4, single-file and sharded,
in the layout `save_pretrained` writes and in transformers 5's packed in-memory layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.loading.hf_config import load_config  # noqa: E402
from moelight.runtime.latent_kv_cache import kv_cache_class  # noqa: E402
from moelight.runtime.plain_executor import PlainExecutor  # noqa: E402
from tests.checkpoints import random_prompts  # noqa: E402

N_NEW = 8
PROMPTS = random_prompts(5, 320, min_len=1, max_len=20, seed=3)
COMMON = dict(vocab_size=320, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
QWEN_SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
DEEPSEEK_SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
                      moe_intermediate_size=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (transformers config class, config kwargs, layout, shard size)
VARIANTS = {
    "qwen2_moe-shared-dense-layer-bias": ("Qwen2MoeConfig", dict(
        **QWEN_SHAPE, intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], rope_theta=1e4),
        "saved", None),
    "qwen2_moe-renorm-sparse-step2-packed-sharded": ("Qwen2MoeConfig", dict(
        **QWEN_SHAPE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2), "packed", "30KB"),
    "qwen3_moe-128ish-experts-top8-sharded": ("Qwen3MoeConfig", dict(
        **QWEN_SHAPE, head_dim=16, intermediate_size=64, moe_intermediate_size=8, num_experts=32,
        num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=True), "saved", "40KB"),
    "qwen3_moe-dense-first-packed": ("Qwen3MoeConfig", dict(
        **QWEN_SHAPE, intermediate_size=40, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0]), "packed", None),
    "olmoe-top3-clip": ("OlmoeConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
        num_experts=8, num_experts_per_tok=3, clip_qkv=0.4), "saved", None),
    "olmoe-norm-topk-sharded": ("OlmoeConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=24,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), "saved", "30KB"),
    "dbrx-top3-clip": ("DbrxConfig", dict(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
        attn_config={"kv_n_heads": 2, "clip_qkv": 0.5, "rope_theta": 1e4},
        ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 6, "moe_top_k": 3}), "saved", None),
    # clip 8 as DBRX ships (transformers 5.24's DBRX cannot run without a clip: clamp(None, None))
    "dbrx-clip8-sharded": ("DbrxConfig", dict(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
        attn_config={"kv_n_heads": 4, "clip_qkv": 8.0, "rope_theta": 5e5},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2}), "saved", "30KB"),
    # sliding window 4 (real: 128) so the short test prompts cross it; YaRN rotary as GPT-OSS ships it
    "gpt_oss-sinks-window4-yarn": ("GptOssConfig", dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, sliding_window=4), "saved", None),
    "gpt_oss-full-first-sharded": ("GptOssConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
        intermediate_size=16, num_local_experts=4, num_experts_per_tok=3, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"]), "saved", "30KB"),
    # DeepSeek (MLA): latent 16 + RoPE 8, nope 8, v 12; V2 softmax routing greedy / group-limited, V3 sigmoid
    # noaux_tc with a score bias; with and without q_lora_rank; dense first layers; shared experts; YaRN mscale
    "deepseek_v2-lite-greedy-no-q-lora": ("DeepseekV2Config", dict(
        **DEEPSEEK_SHAPE, q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy"), "saved", None),
    "deepseek_v2-group-limited-q-lora-yarn-sharded": ("DeepseekV2Config", dict(
        **DEEPSEEK_SHAPE, q_lora_rank=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
        rope_scaling=DEEPSEEK_YARN), "saved", "30KB"),
    "deepseek_v3-groups-q-lora-yarn-packed": ("DeepseekV3Config", dict(
        **DEEPSEEK_SHAPE, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=2.5, rope_scaling=DEEPSEEK_YARN, num_nextn_predict_layers=0),
        "packed", None),
    "deepseek_v3-one-group-no-q-lora-rotate-half": ("DeepseekV3Config", dict(
        **{**DEEPSEEK_SHAPE, "kv_lora_rank": 24, "v_head_dim": 8}, q_lora_rank=None, n_routed_experts=6,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0, rope_interleave=False,
        norm_topk_prob=False, num_nextn_predict_layers=0), "saved", "30KB"),
}
_MODEL_CLASS = {"Qwen2MoeConfig": "Qwen2MoeForCausalLM", "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
                "OlmoeConfig": "OlmoeForCausalLM", "DbrxConfig": "DbrxForCausalLM", "GptOssConfig": "GptOssForCausalLM",
                "DeepseekV2Config": "DeepseekV2ForCausalLM", "DeepseekV3Config": "DeepseekV3ForCausalLM"}


def make_hf(config_class: str, kwargs: dict, seed: int):
    """A float32 transformers model with random weights; norms and biases randomised too, so
    a norm or bias applied wrongly (or not at all) changes the tokens."""
    import transformers

    cfg = getattr(transformers, config_class)(**COMMON, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASS[config_class])(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm_" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias") or name.endswith("_bias"):
                p.uniform_(-0.3, 0.3)
            elif name.endswith("sinks"):  # GPT-OSS: large enough to matter in the softmax
                p.uniform_(-1.0, 1.0)
    return model


def save(model, out: Path, layout: str, shard: str | None) -> Path:
    if layout == "saved":
        model.save_pretrained(out, max_shard_size=shard or "1GB")
    else:  # transformers 5's in-memory names, packed experts, in one file or a few
        out.mkdir(parents=True)
        model.config.save_pretrained(out)
        sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
        if shard is None:
            save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        else:
            names = sorted(sd)
            half = len(names) // 2
            weight_map = {}
            for i, chunk in enumerate((names[:half], names[half:])):
                fname = f"model-{i + 1:05d}-of-00002.safetensors"
                save_file({k: sd[k] for k in chunk}, str(out / fname), metadata={"format": "pt"})
                weight_map |= {k: fname for k in chunk}
            (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def family_ref(request, tmp_path_factory):
    config_class, kwargs, layout, shard = VARIANTS[request.param]
    hf = make_hf(config_class, kwargs, seed=len(request.param))
    folder = save(hf, tmp_path_factory.mktemp("fam") / request.param, layout, shard)
    return request.param, hf, folder


@torch.no_grad()
def hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N_NEW, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_family_matches_transformers(family_ref):
    name, hf, folder = family_ref
    _, _, layout, shard = VARIANTS[name]
    assert (folder / "model.safetensors.index.json").is_file() == (shard is not None)
    llm = LLM(str(folder), dtype="float32", batch_size=3, micro_batch_size=2)
    assert llm.config.model_type == hf.config.model_type
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
    # prefill logits of every prompt's last token, through the unpacked model as well
    from moelight.loading.weights import build_model

    model = build_model(load_config(folder), torch.float32, folder)
    for p in PROMPTS[:3]:
        cache = kv_cache_class(model.config).allocate(model.config, [len(p)], torch.float32)
        ours = PlainExecutor(model).prefill(cache, torch.tensor(p), torch.tensor([len(p)]), cache.offsets)[0]
        with torch.no_grad():
            theirs = hf(torch.tensor([p])).logits[0, -1].float()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_shared_prefixes_match_transformers(family_ref):
    """Prompts behind one 40-token system prompt (two and a half KV pages) and a prompt asked twice:
    computed once through the paged cache (MLA: its latent rows paged, the prefix expanded for the new
    tokens), each still gives transformers' greedy tokens."""
    name, hf, folder = family_ref
    system = random_prompts(1, 320, min_len=40, max_len=40, seed=11)[0]
    prompts = [system + p for p in PROMPTS[:3]] + [system + PROMPTS[0], system[:33]]
    llm = LLM(str(folder), dtype="float32", batch_size=5, micro_batch_size=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in prompts]
    assert llm.last_stats.prefix_reused_tokens >= 3 * 32 + len(prompts[3])


def test_logprobs_are_transformers_log_softmax(family_ref):
    """prompt_logprobs and the greedy tokens' logprobs (top-3 and the chosen one, with ranks) are the
    float32 log-softmax of transformers' logits on the same weights, position by position."""
    name, hf, folder = family_ref
    llm = LLM(str(folder), dtype="float32", batch_size=3, micro_batch_size=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    for p, out in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], params), strict=True):
        sample = out.outputs[0]
        full = p + sample.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
        positions = [(out.prompt_logprobs[i], p[i], ref[i - 1]) for i in range(1, len(p))]
        positions += [(sample.logprobs[t], sample.token_ids[t], ref[len(p) - 1 + t]) for t in range(4)]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
        total = 0.0
        for entry, token, row in positions:
            torch.testing.assert_close(torch.tensor(entry[token].logprob), row[token], rtol=1e-4, atol=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = torch.topk(row, 3)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert abs(entry[tid].logprob - lp) < 1e-4, (name, tid)
        total = sum(sample.logprobs[t][sample.token_ids[t]].logprob for t in range(4))
        assert abs(sample.cumulative_logprob - total) < 1e-5


def test_checkpoint_variants_cover_the_families():
    covered = {VARIANTS[v][0] for v in VARIANTS}
    assert covered == set(_MODEL_CLASS)


# ----------------------------------------------------------------------------- bad input


def _folder(name: str, tmp_path: Path) -> Path:
    config_class, kwargs, _, _ = VARIANTS[name]
    return save(make_hf(config_class, kwargs, seed=1), tmp_path / name, "saved", None)


def _edit(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_unsupported_model_type_lists_the_supported_ones(tmp_path):
    from moelight.errors import ConfigError

    folder = _folder("olmoe-top3-clip", tmp_path)
    _edit(folder, model_type="jamba")
    with pytest.raises(ConfigError, match="'jamba' is not supported.*mixtral, qwen2_moe, qwen3_moe, olmoe, dbrx, "
                                          "gpt_oss, deepseek_v2, deepseek_v3"):
        LLM(str(folder))


@pytest.mark.parametrize("changes, needle", [
    ({"num_experts_per_tok": None}, "missing required field(s) num_experts_per_tok"),
    ({"num_experts": "four"}, 'num_experts must be a whole number, got "four"'),
    ({"num_experts_per_tok": 2.7, "rms_norm_eps": "1e-6"}, "num_experts_per_tok must be a whole number, got 2.7; "
                                                           'rms_norm_eps must be a number, got "1e-6"'),
    ({"num_experts_per_tok": [2]}, "num_experts_per_tok must be a whole number, got [2]"),
])
def test_config_fields_of_the_wrong_type_are_named(tmp_path, changes, needle):
    from moelight.errors import ConfigError

    folder = _folder("olmoe-top3-clip", tmp_path)
    _edit(folder, **changes)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        LLM(str(folder))


def test_a_mixtral_config_with_null_moe_fields_says_they_are_missing():
    from moelight.errors import ConfigError
    from moelight.loading.hf_config import config_from_hf_dict
    from tests.checkpoints import DEFAULTS

    cfg = {"model_type": "mixtral", **DEFAULTS, "num_experts_per_tok": None}
    with pytest.raises(ConfigError, match=re.escape("no MoE fields (num_experts_per_tok missing)")):
        config_from_hf_dict(cfg)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq"])  # GPTQ / AWQ / compressed-tensors: test_int_checkpoints
def test_quantised_checkpoints_say_so_by_name(tmp_path, method):
    from moelight.errors import ConfigError

    folder = _folder("qwen3_moe-dense-first-packed", tmp_path)
    _edit(folder, quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(ConfigError, match=f"'{method}'-quantised qwen3_moe checkpoint; moelight reads GPTQ"):
        LLM(str(folder))


def test_missing_and_misshapen_family_tensors_are_named(tmp_path):
    from safetensors import safe_open

    from moelight.errors import WeightsError
    from moelight.loading.weights import build_model

    folder = _folder("dbrx-top3-clip", tmp_path)
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: v for k, v in tensors.items() if k != "transformer.blocks.1.ffn.experts.mlp.v1"}, str(path))
    with pytest.raises(WeightsError, match=r"missing weights for: layers\.1\.mlp\.gate_up_proj"):
        build_model(load_config(folder), torch.float32, folder)
    tensors["transformer.blocks.0.norm_attn_norm.attn.Wqkv.weight"] = torch.zeros(10, 32)
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"Wqkv\.weight has shape \(\d+, 32\)"):
        build_model(load_config(folder), torch.float32, folder)


def test_a_non_mixtral_family_on_the_emulated_cgopipe_runtime(tmp_path):
    """OLMoE (no renormalisation, q/k norms) through the pipeline executor: the CPU engine's tokens."""
    from optimizer import Policy

    folder = _folder("olmoe-top3-clip", tmp_path)
    pol = str(Policy(4, 2, 2, False, True, 0.5, 0.0, "float32").save(tmp_path / "gpu.json"))
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(folder), dtype="float32", device="cpu", batch_size=4, micro_batch_size=2)
    piped = LLM(str(folder), dtype="float32", device="emulated", hardware="t4", policy=pol)
    try:
        assert [o.outputs[0].token_ids for o in piped.generate(PROMPTS, greedy)] == \
            [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy)]
    finally:
        piped.close()


@pytest.mark.parametrize("schedule", ["cgopipe", "flexgen-cpu"])
def test_dense_layers_and_a_shared_expert_on_the_emulated_runtime(tmp_path, schedule):
    """Qwen2-MoE with a dense layer and a shared expert: the dense MLP and the shared expert stay
    resident, the dense layer pages nothing; the CPU engine's tokens."""
    from optimizer import Policy

    folder = _folder("qwen2_moe-shared-dense-layer-bias", tmp_path)
    pol = str(Policy(4, 2, 2, False, True, 0.34, 0.0, "float32").save(tmp_path / "gpu.json"))
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(folder), dtype="float32", device="cpu", batch_size=4, micro_batch_size=2)
    piped = LLM(str(folder), dtype="float32", device="emulated", hardware="t4", policy=pol, schedule=schedule)
    try:
        assert [o.outputs[0].token_ids for o in piped.generate(PROMPTS, greedy)] == \
            [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy)]
        pager = piped.session._executor.pager
        assert pager.sparse == [True, False, True] and pager.page_bytes(0, 1, 1) == 0
    finally:
        piped.close()


def test_yarn_without_original_max_position_embeddings_reads_as_transformers_reads_it(tmp_path):
    """A config.json (as the Hub's DeepSeek-V2 derivatives can ship it) whose YaRN parameters do not
    name original_max_position_embeddings: transformers takes the model's context for it."""
    import transformers

    folder = _folder("deepseek_v2-group-limited-q-lora-yarn-sharded", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(cfg.get(key), dict):
            cfg[key].pop("original_max_position_embeddings", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = transformers.DeepseekV2ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
