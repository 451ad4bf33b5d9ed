"""benchmarks/peers/decode_ceiling.py: the weight bytes a batch-1 decode token reads, counted from the config,
match what the engine holds (the tiny preset's parameters, its int4 experts as loaded), and the ceilings the
quantized-decode records quote follow from them (bench-1b ~2.2x; Mixtral-8x7B's shape needs 5 layers for
2.5x with 16-bit attention and LM head)."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from moelight.loading.presets import preset_config
from moelight.loading.weights import build_model
from moelight.models.expert_format import quantize_format
from moelight.models.quantized_experts import quantized_experts_of

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "decode_ceiling.py"
_spec = importlib.util.spec_from_file_location("decode_ceiling", _PATH)
dc = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("decode_ceiling", dc)
_spec.loader.exec_module(dc)


def _param_bytes(model, *names: str) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if any(s in n for s in names))


def test_16_bit_parts_match_the_tiny_models_parameters():
    cfg = preset_config("tiny")
    model = build_model(cfg, torch.bfloat16, None)
    got = dc.token_bytes(cfg, None)
    assert got["attention"] == _param_bytes(model, "self_attn.")
    assert got["router"] == _param_bytes(model, "mlp.gate.weight")
    assert got["lm_head"] == _param_bytes(model, "lm_head.")
    assert got["embedding"] == _param_bytes(model, "embed_tokens.") // cfg.vocab_size
    experts = _param_bytes(model, "mlp.gate_up_proj", "mlp.down_proj")  # all E experts of every layer
    assert got["experts"] == experts * cfg.top_k // cfg.num_experts


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_what_the_engine_holds(method):
    base = preset_config("tiny")
    cfg = dataclasses.replace(base, expert_format=quantize_format(method, (base.hidden_size, base.intermediate_size)))
    held = sum(m.nbytes() for m in quantized_experts_of(build_model(cfg, torch.bfloat16, None)).values())
    assert dc.token_bytes(base, method)["experts"] == held * base.top_k // base.num_experts


def test_ceilings_the_records_quote():
    assert dc.ceiling(preset_config("bench-1b"), "int4") == pytest.approx(2.225, abs=0.001)
    mixtral = preset_config("mixtral-8x7b")
    at = {n: dc.ceiling(dataclasses.replace(mixtral, num_layers=n), "int4") for n in (4, 5, 32)}
    assert at[4] < 2.5 < at[5] < at[32] < 2.75
    assert dc.ceiling(mixtral, "int4", baseline="int4") == 1.0


def test_shape_config_cuts_only_the_layers(tmp_path):
    folder = dc.shape_config("mixtral-8x7b", 5, tmp_path / "m")
    written = json.loads((folder / "config.json").read_text())
    full = dict(dc.PRESET_CONFIGS["mixtral-8x7b"])
    assert written == full | {"num_hidden_layers": 5}
    assert dc.model_config(str(folder)) == dataclasses.replace(preset_config("mixtral-8x7b"), num_layers=5)
    with pytest.raises(ValueError, match="Mixtral-shaped"):
        dc.shape_config("qwen3-30b-a3b", 2, tmp_path / "q")
