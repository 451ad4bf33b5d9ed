"""A tied model whose checkpoint stores its one matrix as `lm_head.weight` (no embed_tokens) loads, as
transformers ties it both ways."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moelight.loading.hf_config import load_config
from moelight.loading.weights import build_model

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


def test_tied_checkpoint_with_lm_head_only_loads(tmp_path):
    hf = make_hf_model(seed=3, tie_word_embeddings=True)
    folder = save_checkpoint(hf, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, str(path), metadata={"format": "pt"})
    model = build_model(load_config(folder), torch.float32, folder)
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert model.lm_head.weight is model.embed_tokens.weight
