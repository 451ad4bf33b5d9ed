"""Experts held quantized from load on (models/quantized_experts.py, loading/expert_storage.py).

- `--quantize int8|int4` quantizes each checkpoint tensor as it is read: the codes equal those of
  quantizing the whole loaded model afterwards (round-to-nearest is row-local), bit for bit.
- GPT-OSS's MXFP4 experts are kept packed in a bfloat16 CPU run, and its logits match the same
  checkpoint dequantised at load (the dequantize-then-matmul reference).
- The memory check counts the held format's bytes: a model is measured against the formula.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cpu_kernels import dispatch
from moelight.errors import ConfigError
from moelight.loading.expert_storage import choose_expert_format, with_expert_format
from moelight.loading.hf_config import load_config
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.models.expert_format import ExpertFormat
from moelight.models.quantized_experts import QuantizedExperts
from moelight.planning.memory_check import weight_bytes
from moelight.runtime.cpu_linear import pack_model
from tests.test_fused_experts_engine import _logits, _prompts, _rel

TINY = PRESETS["tiny"]


def _save_checkpoint(model, folder) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(folder / "model.safetensors"))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantizing_while_loading_equals_quantizing_after(tmp_path, method):
    dense = build_model(TINY, torch.bfloat16, None, seed=3)
    _save_checkpoint(dense, tmp_path / "ckpt")
    cfg = with_expert_format(load_config(tmp_path / "ckpt"), torch.bfloat16, "cpu", method, 32)
    held = build_model(cfg, torch.bfloat16, tmp_path / "ckpt")
    assert isinstance(held.layers[0].mlp.gate_up_proj, QuantizedExperts)
    pack_model(held, method, 32)
    pack_model(dense, method, 32)
    for a, b in zip(held.layers, dense.layers, strict=True):
        pa, pb = a.mlp.gate_up_proj.packed, b.mlp.gate_up_proj.packed
        assert pa.fmt13 == pb.fmt13 == {"int8": "int8", "int4": "uint4"}[method]
        for name in ("w13", "s13", "z13", "w2", "s2", "z2"):
            ta, tb = getattr(pa, name), getattr(pb, name)
            assert (ta is None and tb is None) or torch.equal(ta, tb), name


def _gpt_oss_mxfp4_checkpoint(folder) -> None:
    """A small GPT-OSS checkpoint whose experts are random MXFP4 blocks, as the real ones ship."""
    cfg = replace(PRESETS["bench-gpt-oss"], hidden_size=64, intermediate_size=64, num_layers=2, vocab_size=300,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4, top_k=2)
    model = build_model(cfg, torch.float32, None, seed=1)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for n, p in model.named_parameters():
        if n.endswith(("mlp.gate_up_proj", "mlp.down_proj")):
            e, rows, cols = p.shape
            base = "model." + n.replace(".mlp.", ".mlp.experts.")
            tensors[base + "_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g,
                                                      dtype=torch.uint8)
            tensors[base + "_scales"] = torch.randint(119, 123, (e, rows, cols // 32), generator=g,
                                                      dtype=torch.uint8)
        else:
            tensors[_hf_name(n)] = p.detach().contiguous()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    hf = _gpt_oss_hf_config(cfg)
    (folder / "config.json").write_text(json.dumps(hf))


def _hf_name(n: str) -> str:
    n = n.replace(".mlp.gate.", ".mlp.router.").replace(".mlp.expert_bias.gate_up", ".mlp.experts.gate_up_proj_bias")
    n = n.replace(".mlp.expert_bias.down", ".mlp.experts.down_proj_bias")
    return n if n.startswith("lm_head") else "model." + n


def _gpt_oss_hf_config(cfg) -> dict:
    from hrm.model_presets import PRESET_CONFIGS

    hf = dict(PRESET_CONFIGS["bench-gpt-oss"])
    hf.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=2,
              vocab_size=cfg.vocab_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    return hf


def test_mxfp4_experts_kept_packed_match_dequantised(tmp_path, monkeypatch):
    folder = tmp_path / "gpt_oss"
    _gpt_oss_mxfp4_checkpoint(folder)
    shipped = load_config(folder)
    assert shipped.checkpoint_quant == "mxfp4"
    kept_cfg = with_expert_format(shipped, torch.bfloat16, "cpu", "none")
    assert kept_cfg.expert_format == ExpertFormat("mxfp4", 32, origin="checkpoint mxfp4")
    # float32 runs (checked against transformers) dequantise at load; tensor-parallel ranks keep the codes
    # while a rank's down columns (64 / N) hold whole blocks of 32
    assert choose_expert_format(shipped, torch.float32, "cpu", "none") is None
    assert choose_expert_format(shipped, torch.bfloat16, "emulated", "none", ranks=2) == kept_cfg.expert_format
    assert choose_expert_format(shipped, torch.bfloat16, "emulated", "none", ranks=4) is None
    kept = build_model(kept_cfg, torch.bfloat16, folder)
    reference = build_model(shipped, torch.bfloat16, folder)  # MXFP4 values are exact in bf16
    assert kept.layers[0].mlp.gate_up_proj.nbytes() * 3 < reference.layers[0].mlp.gate_up_proj.numel() * 2
    pack_model(kept)
    pack_model(reference)
    assert kept.layers[0].mlp.gate_up_proj.packed.fmt13 == "mxfp4"
    assert reference.layers[0].mlp.gate_up_proj.packed.fmt13 == "bf16"
    prompts = _prompts(300)
    expected = _logits(reference, prompts)
    # on int8 activations (AVX2's MXFP4 path) within their rounding, as int8 / int4 experts
    # (test_fused_experts_engine); on the bf16 path's numbers the codes' values exactly, up to the sums' order
    assert _rel(_logits(kept, prompts), expected) < 3e-2
    monkeypatch.setattr(dispatch, "INT8_ACTIVATIONS", False)
    assert _rel(_logits(kept, prompts), expected) < 1e-2


def test_a_piece_in_another_format_is_named(tmp_path):
    folder = tmp_path / "gpt_oss"
    _gpt_oss_mxfp4_checkpoint(folder)
    wrong = replace(load_config(folder), expert_format=ExpertFormat("uint4", 32, zero=True))
    from moelight.errors import WeightsError

    with pytest.raises(WeightsError, match=r"experts\.\w+_blocks: a mxfp4 piece .* held as uint4"):
        build_model(wrong, torch.bfloat16, folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert any(k.endswith("_blocks") for k in f.keys())


def test_quantize_on_a_quantized_checkpoint_is_refused_before_loading():
    with pytest.raises(ConfigError, match="already mxfp4-quantized; leave --quantize out"):
        choose_expert_format(PRESETS["gpt-oss-20b"], torch.bfloat16, "cpu", "int4")


@pytest.mark.parametrize("form", [ExpertFormat("int8"), ExpertFormat("uint4", 32, zero=True),
                                  ExpertFormat("mxfp4", 32), ExpertFormat("fp8", 32)])
def test_memory_check_counts_the_held_format(form):
    cfg = replace(TINY, expert_format=form)
    model = build_model(cfg, torch.bfloat16, None)
    held = sum(t.numel() * t.element_size() for t in model.parameters())
    if not cfg.tie_word_embeddings:
        assert weight_bytes(cfg, torch.bfloat16) == held
    dense = weight_bytes(TINY, torch.bfloat16)
    assert weight_bytes(cfg, torch.bfloat16) < dense
    logits = _logits(_packed(model), _prompts(cfg.vocab_size))
    assert torch.isfinite(logits).all() and logits.std() > 0


def _packed(model):
    pack_model(model)
    return model


def test_real_presets_fit_a_24_gib_machine_only_quantized():
    from moelight.planning.memory_check import OutOfMemoryPlan, check_fits

    gib = 2**30
    oss = with_expert_format(PRESETS["gpt-oss-20b"], torch.bfloat16, "cpu", "none")
    check_fits(oss, torch.bfloat16, 64 * 256, available=22 * gib)
    qwen = with_expert_format(PRESETS["qwen3-30b-a3b"], torch.bfloat16, "cpu", "int4")
    check_fits(qwen, torch.bfloat16, 64 * 256, available=22 * gib)
    oss_ranks = with_expert_format(PRESETS["gpt-oss-20b"], torch.bfloat16, "emulated", "none", ranks=2)
    assert oss_ranks.expert_format == oss.expert_format  # 2 ranks hold 1,440 columns each: whole blocks of 32
    check_fits(oss_ranks, torch.bfloat16, 64 * 256, available=22 * gib, ranks=2)
    for dense in (PRESETS["gpt-oss-20b"], PRESETS["qwen3-30b-a3b"]):
        with pytest.raises(OutOfMemoryPlan, match="short by"):
            check_fits(dense, torch.bfloat16, 64 * 512, available=22 * gib)


def test_fp8_experts_kept_in_e4m3_match_dequantised(tmp_path):
    """DeepSeek-V3's FP8 routed experts kept as shipped (attention, shared and dense MLPs dequantised)."""
    from moelight.models.fp8 import quantize_fp8_blocks
    from tests.test_deepseek_checkpoints import hf_model, saved, write

    hf = hf_model(hidden_size=64, moe_intermediate_size=32)
    tensors, config = saved(hf, tmp_path / "hf")
    from moelight.models.deepseek import _FP8_WEIGHT

    for name in [n for n in tensors if _FP8_WEIGHT.search(n.replace(".shared_experts.", ".shared_expert."))]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(tensors[name], (32, 32))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}
    folder = write(tmp_path / "fp8", tensors, config)
    shipped = load_config(folder)
    kept_cfg = with_expert_format(shipped, torch.bfloat16, "cpu", "none")
    assert kept_cfg.expert_format == ExpertFormat("fp8", 32, origin="checkpoint fp8")
    kept, reference = build_model(kept_cfg, torch.bfloat16, folder), build_model(shipped, torch.bfloat16, folder)
    sparse = kept_cfg.dense_layers[-1] + 1
    assert isinstance(kept.layers[sparse].mlp.gate_up_proj, QuantizedExperts)
    pack_model(kept)
    pack_model(reference)
    assert kept.layers[sparse].mlp.gate_up_proj.packed.fmt2 == "fp8"
    prompts = _prompts(shipped.vocab_size)
    assert _rel(_logits(kept, prompts), _logits(reference, prompts)) < 2e-2


def test_mxfp4_experts_paged_as_shipped_on_a_gpu(tmp_path):
    """One GPU pages GPT-OSS's MXFP4 experts as shipped and expands them before its GEMMs: the same
    logits, pass by pass, as the runtime over the checkpoint dequantised at load (MXFP4 values and
    their power-of-two scales are exact in bf16)."""
    from moelight.pipeline.pipeline_executor import PipelineExecutor
    from moelight.sampling.params import SamplingParams
    from tests.runtime_check import assert_same_run, run_job

    folder = tmp_path / "gpt_oss"
    _gpt_oss_mxfp4_checkpoint(folder)
    shipped = load_config(folder)
    kept_cfg = with_expert_format(shipped, torch.bfloat16, "emulated", "none")
    assert kept_cfg.expert_format.fmt == "mxfp4"
    prompts = _prompts(300)
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * len(prompts)
    runs = []
    for cfg in (kept_cfg, shipped):
        model = build_model(cfg, torch.bfloat16, folder)
        ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, max_prefill_tokens=64, max_prompt_len=32,
                              max_batch=4, max_context=40)
        try:
            runs.append(run_job(model, ex, prompts, params, 4, 2, max_prefill_tokens=64))
            assert ex.pager.quantized == (cfg is kept_cfg)
        finally:
            ex.close()
    assert_same_run(runs[0], runs[1], rtol=0, atol=0, what="MXFP4 paged as shipped")
