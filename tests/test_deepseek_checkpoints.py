"""DeepSeek checkpoints as they ship: V3's FP8 e4m3 weights with block scales (dequantised at load, the
tokens transformers gives on the dequantised weights), the MTP layer (ignored, said so), Kimi-K2's own
model_type; and configs moelight cannot run, refused before any weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelight.errors import ConfigError, WeightsError
from moelight.loading.hf_config import load_config
from moelight.loading.weights import build_model
from moelight.models.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from tests.checkpoints import random_prompts

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=320, hidden_size=40, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
             q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             initializer_range=0.2, num_nextn_predict_layers=0)
BLOCK = [16, 16]  # hidden 40 and latent + rope 24: tiles cut short at the edges
PROMPTS = random_prompts(3, 320, min_len=2, max_len=12, seed=4)


def hf_model(seed: int = 0, **overrides):
    cfg = transformers.DeepseekV3Config(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("_bias"):
                p.uniform_(-0.3, 0.3)
    return model


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}
    return out


def write(folder: Path, tensors: dict, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    return folder


def saved(model, folder: Path) -> tuple[dict, dict]:
    model.save_pretrained(folder)
    return tensors_of(folder), json.loads((folder / "config.json").read_text())


def greedy(model, prompts=PROMPTS) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6, eos_token_id=None,
                               pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):]
                .tolist() for p in prompts]


def ours(folder: Path) -> list[list[int]]:
    from moelight import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", batch_size=3, micro_batch_size=2)
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def test_block_dequantisation_is_exact_per_tile():
    w = torch.randn(40, 24) * torch.linspace(0.1, 3, 24)  # columns of different scale
    q, s = quantize_fp8_blocks(w, (16, 16))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    d = dequantize_fp8_blocks(q, s, (16, 16))
    for i, j in ((0, 0), (2, 1)):  # a full tile and the corner one cut short on both sides
        tile = (slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16))
        torch.testing.assert_close(d[tile], q[tile].float() * s[i, j], rtol=0, atol=0)
    scale = s.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :24]
    assert ((d - w).abs() <= w.abs() / 16 + scale * 2**-9).all()  # e4m3: 3 mantissa bits, subnormals 2^-9
    with pytest.raises(ValueError, match=r"needs \(3, 2\)"):
        dequantize_fp8_blocks(q, s[:2], (16, 16))


def test_fp8_checkpoint_loads_dequantised_and_matches_transformers(tmp_path):
    hf = hf_model()
    tensors, config = saved(hf, tmp_path / "fp8")
    from moelight.models.deepseek import _FP8_WEIGHT

    quantised = 0
    for name in list(tensors):
        if _FP8_WEIGHT.search(name.removeprefix("model.").replace(".shared_experts.", ".shared_expert.")):
            q, s = quantize_fp8_blocks(tensors[name], tuple(BLOCK))
            tensors[name], tensors[name + "_scale_inv"] = q, s
            quantised += 1
    assert quantised > 40  # attention, experts, shared experts and the dense MLP
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK,
                                     "activation_scheme": "dynamic"}
    folder = write(tmp_path / "fp8", tensors, config)
    # transformers on the very values the checkpoint holds, written out dequantised
    plain = {k: (dequantize_fp8_blocks(t, tensors[k + "_scale_inv"], tuple(BLOCK)) if t.dtype == torch.float8_e4m3fn
                 else t) for k, t in tensors.items() if not k.endswith("_scale_inv")}
    write(tmp_path / "plain", plain, {k: v for k, v in config.items() if k != "quantization_config"})
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    assert ours(folder) == greedy(reference)
    assert ours(folder) != greedy(hf)  # the quantisation changed the model: the test would see it ignored


def test_the_mtp_layer_is_skipped_and_said_to_be(tmp_path):
    hf = hf_model(seed=1)
    tensors, config = saved(hf, tmp_path / "mtp")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k}
    mtp |= {"model.layers.3.enorm.weight": torch.ones(40), "model.layers.3.eh_proj.weight": torch.zeros(40, 80)}
    folder = write(tmp_path / "mtp", tensors | mtp, config | {"num_nextn_predict_layers": 1})
    with pytest.warns(UserWarning, match="num_nextn_predict_layers=1: the multi-token-prediction head is ignored"):
        cfg = load_config(folder)
    assert cfg.ignored_layers == 1
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        assert ours(folder) == greedy(hf)
    extra = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in mtp.items()}
    write(folder, tensors | mtp | extra, config | {"num_nextn_predict_layers": 1})
    with pytest.warns(UserWarning), pytest.raises(WeightsError, match="num_hidden_layers=3"):
        build_model(load_config(folder), torch.float32, folder)


def test_kimi_k2_loads_through_the_v3_family(tmp_path):
    hf = hf_model(seed=2)
    tensors, config = saved(hf, tmp_path / "kimi")
    folder = write(tmp_path / "kimi", tensors, config | {"model_type": "kimi_k2",
                                                         "architectures": ["DeepseekV3ForCausalLM"]})
    assert load_config(folder).group_routing.method == "noaux_tc"
    assert ours(folder) == greedy(hf)


@pytest.mark.parametrize("change,match", [
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported for deepseek_v3.*'noaux_tc'"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' with topk_method 'noaux_tc' is not supported"),
    ({"model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "routes with scoring_func 'softmax'"),
    ({"model_type": "deepseek_v2", "norm_topk_prob": True}, "norm_topk_prob is true for a deepseek_v2 model"),
    ({"n_group": 3}, "n_group 3 must divide n_routed_experts"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "fmt 'e5m2'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [0, 0]}},
     r"weight_block_size \[0, 0\].*two positive whole numbers"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     r"rope scaling .linear. is not supported"),
])
def test_configs_it_cannot_run_are_refused_before_loading(tmp_path, change, match):
    tensors, config = saved(hf_model(), tmp_path / "bad")
    folder = write(tmp_path / "bad", tensors, config | change)
    (folder / "model.safetensors").write_bytes(b"not weights")  # the refusal must come before any read
    from moelight import LLM

    with pytest.raises(ConfigError, match=match):
        LLM(str(folder))


def _fp8_keeping(tmp_path, kept: str, listed: list[str]) -> tuple[Path, Path]:
    """(FP8 folder with every FP8-able weight quantized but `kept`, stored in float; the same values plain)."""
    from moelight.models.deepseek import _FP8_WEIGHT

    tensors, config = saved(hf_model(seed=3), tmp_path / "fp8")
    plain = dict(tensors)
    for name in list(tensors):
        if _FP8_WEIGHT.search(name.removeprefix("model.").replace(".shared_experts.", ".shared_expert.")) \
                and kept not in name:
            q, s = quantize_fp8_blocks(tensors[name], tuple(BLOCK))
            tensors[name], tensors[name + "_scale_inv"] = q, s
            plain[name] = dequantize_fp8_blocks(q, s, tuple(BLOCK))
    write(tmp_path / "plain", plain, dict(config))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": BLOCK,
                                     "modules_to_not_convert": listed}
    return write(tmp_path / "fp8", tensors, config), tmp_path / "plain"


def test_a_module_kept_in_float_by_modules_to_not_convert_loads_plain(tmp_path):
    folder, plain = _fp8_keeping(tmp_path, "kv_a_proj_with_mqa", ["kv_a_proj_with_mqa", "lm_head"])
    ours_, reference = (build_model(load_config(d), torch.float32, d) for d in (folder, plain))
    for (n, a), b in zip(ours_.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_an_fp8_tensor_listed_as_float_is_named(tmp_path):
    folder, _ = _fp8_keeping(tmp_path, "no module", ["o_proj"])
    with pytest.raises(WeightsError, match=r"o_proj\.weight is stored in torch\.float8_e4m3fn without its scale"):
        build_model(load_config(folder), torch.float32, folder)
