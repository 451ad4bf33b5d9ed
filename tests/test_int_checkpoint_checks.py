"""Quantized-checkpoint configs that do not match what moelight reads, or that do not match the tensors:
refused with the field or tensor named (before loading where config.json alone shows it), never loaded
with scales on the wrong columns (loading/int_checkpoints.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelight.errors import ConfigError, WeightsError
from moelight.loading.hf_config import config_from_hf_dict, load_config
from moelight.loading.weights import build_model
from tests.test_int_checkpoints import TINY, _checkpoints


def _ct(weights: dict, fmt: str = "pack-quantized") -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": {"targets": ["Linear"],
                                                                                        "weights": weights}}}


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     r"checkpoint_format 'marlin' is not supported; moelight reads GPTQ's 'gptq' and 'gptq_v2'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "bogus"}, "'bogus' is not supported"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32, "version": "gemm"}, "AWQ with bits 8 .* 4-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, "zero_point False"),
    (_ct({"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}), "of type 'float'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}), "strategy 'group' need a positive group_size"),
    (_ct({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [0, 128]}, "float-quantized"),
     r"block_structure \[0, 128\]"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [0, 0]}, r"weight_block_size \[0, 0\]"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, -128]}, r"weight_block_size \[128, -128\]"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "modules_to_not_convert": "lm_head"},
     "modules_to_not_convert must be a list"),
])
def test_configs_moelight_cannot_read_are_named_before_loading(quant, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf_dict(TINY.to_hf_dict() | {"quantization_config": quant}, "config.json")


def _edited(folder, tensors=None, quant=None):
    if tensors is not None:
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))
    if quant is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] |= quant
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


DOWN = "model.layers.1.block_sparse_moe.experts.3.w2"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_size_the_scales_do_not_have_is_named(tmp_path, dtype):
    quantized, _ = _checkpoints(tmp_path, "gptq-int4-sym")  # g32 tensors, config.json says 64, no g_idx
    drop = lambda t: [t.pop(k) for k in list(t) if k.endswith("g_idx")]  # noqa: E731
    folder = _edited(quantized, drop, {"group_size": 64})
    with pytest.raises(WeightsError, match=r"scales have 2 groups per row; K=64 in config.json's group_size needs 1"):
        build_model(load_config(folder), dtype, folder)


def test_a_g_idx_out_of_range_is_named(tmp_path):
    quantized, _ = _checkpoints(tmp_path, "gptq-int4-sym")
    folder = _edited(quantized, lambda t: t.__setitem__(f"{DOWN}.g_idx", t[f"{DOWN}.g_idx"] + 5))
    with pytest.raises(WeightsError, match=rf"{DOWN}.weight's tensors .*g_idx has 128 entries in 5..8; it needs "
                                           r"K=128 group numbers in 0..3"):
        build_model(load_config(folder), torch.float32, folder)


def test_the_int4_width_limit_names_the_option_as_given(tmp_path):
    from moelight import LLM

    (tmp_path / "config.json").write_text(json.dumps(replace(TINY, intermediate_size=40).to_hf_dict()))
    with pytest.raises(ConfigError, match=r"--quantize int4-g32: .*input widths \(64, 40\).*multiples of 32"):
        LLM(str(tmp_path), load_format="dummy", quantize="int4-g32", tokenizer="none")
