"""A checkpoint tensor the config's model has no place for is refused by name, as transformers reports it
UNEXPECTED: dropping it silently would change the outputs (attention biases under attention_bias false)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moelight.errors import WeightsError
from moelight.loading.hf_config import load_config
from moelight.loading.weights import build_model

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=5), tmp_path_factory.mktemp("good") / "single", "legacy", 1)


@pytest.fixture
def ckpt(good, tmp_path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "m"))


def _add(folder: Path, **tensors: torch.Tensor) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        held = {k: f.get_tensor(k) for k in f.keys()}
    save_file(held | tensors, str(path), metadata={"format": "pt"})


def load(folder: Path):
    return build_model(load_config(folder), torch.float32, folder)


def test_attention_bias_the_config_turns_off_is_refused(ckpt):
    _add(ckpt, **{"model.layers.1.self_attn.q_proj.bias": torch.full((32,), 0.5)})
    with pytest.raises(WeightsError) as e:
        load(ckpt)
    msg = str(e.value)
    assert "model.layers.1.self_attn.q_proj.bias" in msg and "attention_bias" in msg
    assert str(ckpt / "model.safetensors") in msg


def test_unknown_tensor_inside_a_layer_is_refused(ckpt):
    _add(ckpt, **{"model.layers.0.mlp.something.weight": torch.zeros(4)})
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.something\.weight has no place"):
        load(ckpt)


def test_ignorable_names_still_load(ckpt):
    """Rotary buffers of old checkpoints and all-zero biases (some GPTQ exports) change nothing."""
    _add(ckpt, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
                  "model.layers.0.self_attn.k_proj.bias": torch.zeros(16)})
    load(ckpt)
