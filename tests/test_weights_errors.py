"""Bad model folders and bad prompts fail with one clear error naming the file and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelight import LLM, SamplingParams
from moelight.errors import ConfigError, MoelightError, PromptError, WeightsError
from moelight.loading.hf_config import load_config
from moelight.loading.model_source import resolve_model
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=5)


@pytest.fixture(scope="module")
def good_single(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("good") / "single", "legacy", 1)


@pytest.fixture(scope="module")
def good_sharded(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("good") / "sharded", "packed", 3)


@pytest.fixture
def ckpt(good_single, tmp_path) -> Path:
    """A fresh copy of the good single-file checkpoint to break."""
    return Path(shutil.copytree(good_single, tmp_path / "m"))


@pytest.fixture
def sharded(good_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(good_sharded, tmp_path / "s"))


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg, indent=2))


def load(folder: Path):
    return build_model(load_config(folder), torch.float32, folder)


def test_good_checkpoints_load(good_single, good_sharded, hf_model):
    """The baseline the other tests break: both load and hold the checkpoint's weights."""
    for folder in (good_single, good_sharded):
        m = load(folder)
        assert torch.equal(m.embed_tokens.weight, hf_model.model.embed_tokens.weight)
        assert torch.equal(m.layers[1].mlp.down_proj, hf_model.model.layers[1].mlp.experts.down_proj)


# ----------------------------------------------------------------------------- config.json


def test_unknown_model_type(ckpt):
    edit_config(ckpt, model_type="llama")
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpt))
    msg = str(e.value)
    assert str(ckpt / "config.json") in msg and "'llama'" in msg and "not supported" in msg


@pytest.mark.parametrize("drop", [("num_local_experts", "num_experts_per_tok"), ("num_local_experts",)])
def test_config_without_moe_fields(ckpt, drop):
    edit_config(ckpt, **{k: None for k in drop})
    with pytest.raises(ConfigError) as e:
        resolve_model(str(ckpt))
    msg = str(e.value)
    assert str(ckpt / "config.json") in msg and "MoE" in msg
    assert all(k in msg for k in drop)


def test_config_invalid_json(ckpt):
    (ckpt / "config.json").write_text('{\n  "model_type": "mixtral",\n  "vocab_size": ,\n}')
    with pytest.raises(ConfigError) as e:
        load_config(ckpt)
    assert f"{ckpt / 'config.json'}:3" in str(e.value) and "invalid JSON" in str(e.value)


def test_config_missing(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpt))
    assert str(ckpt / "config.json") in str(e.value) and "not found" in str(e.value)


def test_config_missing_required_field(ckpt):
    edit_config(ckpt, hidden_size=None)
    with pytest.raises(ConfigError, match="hidden_size") as e:
        load_config(ckpt)
    assert str(ckpt / "config.json") in str(e.value)


def test_config_heads_not_divisible():
    with pytest.raises(ConfigError, match="multiple"):
        ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=3, num_experts=4, top_k=2)


def test_config_top_k_above_experts(ckpt):
    edit_config(ckpt, num_experts_per_tok=9)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(ckpt)


def test_config_rope_scaling_refused(ckpt):
    edit_config(ckpt, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(ConfigError, match="rope scaling 'dynamic' is not supported") as e:
        load_config(ckpt)
    assert str(ckpt / "config.json") in str(e.value)


def test_model_neither_folder_nor_preset(tmp_path):
    with pytest.raises(ConfigError, match="no such folder and not a preset"):
        resolve_model(str(tmp_path / "nope"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a folder"):
        resolve_model(str(f))


def test_bad_dtype_and_load_format(ckpt):
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_model(str(ckpt), dtype="float8")
    with pytest.raises(ConfigError, match="--load-format"):
        resolve_model(str(ckpt), load_format="gguf")
    with pytest.raises(ConfigError, match="preset"):
        resolve_model("tiny", load_format="safetensors")


def test_an_hf_tokenizer_asked_of_a_preset_is_refused():
    from moelight.errors import TokenizerError
    from moelight.loading.resolved_model import resolve

    with pytest.raises(TokenizerError, match="--tokenizer hf: tiny is a preset with no tokenizer.json"):
        resolve("tiny", load_format="dummy", tokenizer="hf")
    assert resolve("tiny", load_format="dummy").tokenizer is not None  # auto: the byte-level tokenizer


# ----------------------------------------------------------------------------- safetensors


def test_missing_safetensors(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(WeightsError) as e:
        LLM(str(ckpt), dtype="float32")
    msg = str(e.value)
    assert str(ckpt) in msg and "no model.safetensors" in msg and "--load-format dummy" in msg


def test_missing_shard(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightsError) as e:
        load(sharded)
    msg = str(e.value)
    assert str(sharded / "model.safetensors.index.json") in msg
    assert "model-00002-of-00003.safetensors" in msg and "missing" in msg


def test_corrupt_index(sharded):
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightsError) as e:
        load(sharded)
    assert str(sharded / "model.safetensors.index.json") in str(e.value)


@pytest.mark.parametrize("keep", [0.6, 0.95])
def test_truncated_safetensors(ckpt, keep):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(WeightsError) as e:
        LLM(str(ckpt), dtype="float32")
    msg = str(e.value)
    assert str(path) in msg and "truncated" in msg


def test_truncated_shard(sharded):
    path = sharded / "model-00003-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsError) as e:
        load(sharded)
    assert str(path) in str(e.value) and "truncated" in str(e.value)


CUT_HEADERS = [b"", b"\x01\x02\x03", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":", b"garbage" * 40]


@pytest.mark.parametrize("content", CUT_HEADERS)
def test_cut_header_or_not_safetensors(ckpt, content):
    path = ckpt / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    assert str(path) in str(e.value)


def _rewrite(path: Path, change) -> None:
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path))


def test_missing_tensor(ckpt):
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    msg = str(e.value)
    assert str(ckpt) in msg and "missing weights" in msg and "model.layers.1.self_attn.k_proj.weight" in msg


def test_missing_tensor_named_as_the_index_lists_it(sharded):
    """The checkpoint's name and the shard the index assigns it to, not moelight's parameter name."""
    shard = sharded / "model-00002-of-00003.safetensors"
    with safe_open(str(shard), framework="pt") as f:
        name = next(k for k in f.keys() if k.endswith("layernorm.weight"))
    _rewrite(shard, lambda t: t.pop(name))
    with pytest.raises(WeightsError) as e:
        load(sharded)
    assert f"{name} (the index puts it in model-00002-of-00003.safetensors, which does not hold it)" in str(e.value)


def test_missing_expert(ckpt):
    name = "model.layers.0.block_sparse_moe.experts.3.w3.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=r"missing weights.*layers\.0\.mlp\.gate_up_proj \(one or more routed "
                                           r"experts' tensors of layer 0\)"):
        load(ckpt)


def test_missing_lm_head_named_as_the_checkpoint_names_it(ckpt):
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    assert "missing weights for: lm_head.weight" in str(e.value)  # not model.lm_head.weight


def test_shape_mismatch_names_tensor_and_file(ckpt):
    edit_config(ckpt, intermediate_size=40)  # checkpoint has 48
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    msg = str(e.value)
    assert str(ckpt / "model.safetensors") in msg and "has shape" in msg and "experts" in msg


def test_more_experts_in_checkpoint_than_config(ckpt):
    edit_config(ckpt, num_local_experts=2)
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    assert "num_local_experts=2" in str(e.value) and str(ckpt / "model.safetensors") in str(e.value)


def test_more_layers_in_checkpoint_than_config(ckpt):
    edit_config(ckpt, num_hidden_layers=1)
    with pytest.raises(WeightsError, match="num_hidden_layers=1"):
        load(ckpt)


# ----------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("tiny", load_format="dummy", dtype="float32")


def test_empty_prompt(tiny_llm):
    """vLLM refuses a prompt of no tokens; blank text is a prompt (the byte tokenizer's BOS, the spaces)."""
    with pytest.raises(PromptError, match="prompt 1 is empty: it has no tokens"):
        tiny_llm.generate([[5, 6], []], SamplingParams(max_tokens=2))
    out = tiny_llm.generate(["", "  \n", {"prompt": " "}], SamplingParams(max_tokens=2))
    assert [len(o.prompt_token_ids) for o in out] == [1, 4, 2] and all(len(o.outputs[0].token_ids) for o in out)


def test_prompt_longer_than_context(tiny_llm):
    ctx = tiny_llm.config.max_position_embeddings
    with pytest.raises(PromptError) as e:
        tiny_llm.generate([[7] * 3, [7] * (ctx + 5)], SamplingParams(max_tokens=2))
    assert "prompt 1" in str(e.value) and str(ctx + 5) in str(e.value) and f"context is {ctx}" in str(e.value)


def test_prompt_near_context_gets_fewer_tokens(tiny_llm):
    ctx = tiny_llm.config.max_position_embeddings
    with pytest.warns(UserWarning, match="max_tokens cut"):
        out = tiny_llm.generate([[7] * (ctx - 3)], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].finish_reason == "length"


def test_sampling_params_count_mismatch(tiny_llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        tiny_llm.generate([[5]] * 3, [SamplingParams()] * 2)


def test_errors_share_a_base_class():
    assert issubclass(ConfigError, MoelightError) and issubclass(WeightsError, MoelightError)
    assert issubclass(PromptError, MoelightError)
