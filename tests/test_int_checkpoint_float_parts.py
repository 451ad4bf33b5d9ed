"""Quantized checkpoints that keep some modules in float (loading/checkpoint_experts.py): HF's
modules_to_not_convert, compressed-tensors' ignore, or a layer simply stored unquantized. As in
transformers and vLLM, those load as plain weights: routed experts all in float are plain 16-bit
experts (never re-quantized into the config's format), a float / quantized mix is held only where every
expert is dequantised at load, and a module listed as float but stored quantized is named.
"""

from __future__ import annotations

import pytest
import torch

from moelight.errors import ConfigError, WeightsError
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.hf_config import load_config
from moelight.loading.weights import build_model
from tests.test_int_checkpoints import CASES, TINY, _hf_linears, _quant_config, _write


def _checkpoints(tmp_path, case: str, in_float, listed: list[str] | None):
    """(quantized, plain) folders: every linear quantized as `case` except those `in_float(name)` keeps."""
    pack, bits, group, sym, v1, act, quant = CASES[case]
    quant = dict(_quant_config(quant))  # CASES stays as it is
    if listed is not None:
        quant |= {"ignore": ["lm_head", *listed]} if "ignore" in quant else {"modules_to_not_convert": listed}
    quantized, plain = {}, {}
    for name, w in _hf_linears(build_model(TINY, torch.float32, None, seed=5)).items():
        if (name.endswith("proj.weight") or ".experts." in name) and not in_float(name):
            parts, values = pack(w, bits, group, sym, v1, act)
            quantized |= {f"{name.removesuffix('.weight')}.{p}": t.contiguous() for p, t in parts.items()}
            plain[name] = values.contiguous()
        else:
            quantized[name] = plain[name] = w
    _write(tmp_path / "quantized", quantized, quant)
    _write(tmp_path / "plain", plain, None)
    return tmp_path / "quantized", tmp_path / "plain"


def _same_weights(a, b):
    for (n, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y), n


def _experts(name: str) -> bool:
    return ".experts." in name


@pytest.mark.parametrize("listed", [None, ["block_sparse_moe"]], ids=["stored-float", "listed"])
@pytest.mark.parametrize("case", ["gptq-int4-sym", "gptq-int8-asym", "ct-w4a16-sym", "ct-fp8", "fp8-block"])
def test_float_experts_load_as_plain_16_bit_experts(tmp_path, case, listed):
    if listed and case.startswith("ct"):
        listed = ["re:.*block_sparse_moe.experts.*"]
    quantized, plain = _checkpoints(tmp_path, case, _experts, listed)
    cfg = with_expert_format(load_config(quantized), torch.bfloat16, "cpu", "none")
    assert cfg.expert_format is None and cfg.experts_all_float
    _same_weights(build_model(cfg, torch.bfloat16, quantized), build_model(load_config(plain), torch.bfloat16, plain))
    assert with_expert_format(load_config(quantized), torch.bfloat16, "cpu", "int8").expert_format.fmt == "int8"


@pytest.mark.parametrize("case", ["gptq-int4-sym", "fp8-block"])
def test_a_float_and_quantized_expert_mix_is_named_where_experts_stay_quantized(tmp_path, case):
    quantized, plain = _checkpoints(tmp_path, case, lambda n: "layers.0.block_sparse_moe.experts" in n, None)
    with pytest.raises(ConfigError, match=r"layers\.0\.block_sparse_moe\.experts\.0\.w1\.weight is stored in "
                                          r"float and .*layers\.1\.block_sparse_moe.*-quantized.*--dtype float32"):
        with_expert_format(load_config(quantized), torch.bfloat16, "cpu", "none")
    cfg = with_expert_format(load_config(quantized), torch.float32, "cpu", "none")  # all dequantised at load
    _same_weights(build_model(cfg, torch.float32, quantized), build_model(load_config(plain), torch.float32, plain))


def test_a_module_listed_as_float_but_stored_quantized_is_named(tmp_path):
    quantized, _ = _checkpoints(tmp_path, "gptq-int4-sym", lambda n: False, ["o_proj"])
    with pytest.raises(WeightsError, match=r"layers\.0\.self_attn\.o_proj is kept in float by quantization_config "
                                           r"\(modules_to_not_convert / ignore\) but stored gptq-quantized"):
        load_config(quantized)
