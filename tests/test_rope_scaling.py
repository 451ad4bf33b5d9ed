"""RoPE scaling (linear, Llama 3, YaRN) on every GQA family, against transformers' own classes: a
config's scaling is computed as transformers computes it, or refused before loading, never ignored."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.errors import ConfigError, OptionError  # noqa: E402
from moelight.loading.hf_config import load_config  # noqa: E402
from tests.checkpoints import random_prompts  # noqa: E402
from tests.test_model_families import hf_greedy, make_hf, save  # noqa: E402

PROMPTS = random_prompts(3, 320, min_len=40, max_len=100, seed=5)  # past the original 64
ORIGINAL = 64  # with max_position_embeddings 256: the YaRN factor 4 it implies
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}
GQA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(**GQA, head_dim=8, intermediate_size=24, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(**GQA, intermediate_size=32, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(**GQA, head_dim=16, intermediate_size=32, moe_intermediate_size=16,
                                         num_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(**GQA, intermediate_size=24, num_experts=4, num_experts_per_tok=2)),
    "dbrx": ("DbrxConfig", dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=256,
                                attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4},
                                ffn_config={"ffn_hidden_size": 24, "moe_num_experts": 4, "moe_top_k": 2})),
}


@pytest.fixture(autouse=True)
def _mixtral_class():
    from tests import test_model_families as fam

    fam._MODEL_CLASS.setdefault("MixtralConfig", "MixtralForCausalLM")


def _model(family: str, scaling: dict | None, tmp_path):
    config_class, kwargs = FAMILIES[family]
    rope = {"rope_theta": 1e4, **(scaling or {"rope_type": "default"})}
    hf = make_hf(config_class, {**kwargs, "rope_parameters": rope}, seed=7)
    return hf, save(hf, tmp_path / family, "saved", None)


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_scaled_rope_matches_transformers(family, kind, tmp_path):
    hf, folder = _model(family, SCALINGS[kind], tmp_path)
    assert hf.config.rope_parameters["rope_type"] == kind  # transformers runs the scaling under test
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float(), -1)
        first = outs[0].outputs[0]
        got = first.logprobs[0][first.token_ids[0]].logprob
        assert got == pytest.approx(ref[first.token_ids[0]].item(), abs=1e-4)
    finally:
        llm.close()


def test_the_scaling_changes_the_tokens(tmp_path):
    """The comparison above can fail: the same weights without the scaling write other tokens."""
    hf, folder = _model("dbrx", SCALINGS["linear"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(hf, p) for p in PROMPTS]
    finally:
        llm.close()


@pytest.mark.parametrize("rope,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope scaling 'dynamic' is not supported \(supported: linear"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope scaling 'longrope' is not supported"),
    ({"rope_type": "yarn"}, "rope scaling 'yarn' needs factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor, original_max_position"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
])
@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_scalings_it_cannot_compute_are_refused_by_name(family, rope, match, tmp_path):
    _, folder = _model(family, None, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 1e4, **rope}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match) as e:
        load_config(folder)
    assert str(folder / "config.json") in str(e.value)


def test_rope_scaling_beside_a_different_rope_parameters_is_refused(tmp_path):
    """A model card's rope_scaling recipe added to a config transformers 5 saved (rope_parameters of type
    default): transformers takes rope_scaling and drops rope_parameters' rope_theta for its class
    default, so moelight names the conflict rather than run either reading."""
    _, folder = _model("qwen3_moe", None, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "default"
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="both rope_parameters .* and rope_scaling .*write the scaling into "
                                          "rope_parameters"):
        load_config(folder)
    cfg["rope_scaling"] = dict(cfg["rope_parameters"])  # the same parameters twice: no conflict
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_config(folder).rope_scaling == ()


def test_a_top_level_partial_rotary_factor_is_refused(tmp_path):
    _, folder = _model("mixtral", None, tmp_path)
    cfg = json.loads((folder / "config.json").read_text()) | {"partial_rotary_factor": 0.5}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.5 is not supported"):
        load_config(folder)


def test_transformers_4_rope_scaling_key_is_read(tmp_path):
    """Older configs name the scaling `rope_scaling` with `type`, and rope_theta at the top level."""
    hf, folder = _model("mixtral", SCALINGS["linear"], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg |= {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert dict(load_config(folder).rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    llm = LLM(str(folder), dtype="float32")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
    finally:
        llm.close()


def test_yarn_runs_past_max_position_embeddings_as_vllm_derives_the_context(tmp_path):
    """A Qwen3 model card's YaRN recipe (max_position_embeddings 40, original 32, factor 4): the context is
    32 x 4 = 128 (vLLM's max_model_len), so a 60-token prompt runs as transformers runs it, LLM takes
    max_model_len up to 128, and above it the error names the derivation."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}
    config_class, kwargs = FAMILIES["qwen3_moe"]
    hf = make_hf(config_class, {**kwargs, "rope_parameters": rope}, seed=7)
    hf.config.max_position_embeddings = 40  # YaRN with a factor reads it nowhere: the weights' outputs stay
    folder = save(hf, tmp_path / "card", "saved", None)
    prompt = random_prompts(1, 320, min_len=60, max_len=60, seed=3)[0]
    llm = LLM(str(folder), dtype="float32", max_model_len=100)
    try:
        assert llm.config.context_length == 128
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt)
    finally:
        llm.close()
    with pytest.raises(OptionError, match=r"max_model_len 129 is above the model's context, 128 tokens \(config.json's "
                                          r"original_max_position_embeddings 32 x its yarn RoPE scaling factor 4\)"):
        LLM(str(folder), dtype="float32", max_model_len=129)
