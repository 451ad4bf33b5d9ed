"""`--dtype auto` takes config.json's dtype as transformers reads it (a name in torch: "float" is float32,
"half" float16) and refuses any other value by config.json's field, not as a bad --dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelight.errors import ConfigError
from moelight.loading.model_source import resolve_model

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_checkpoint(make_hf_model(seed=2), tmp_path_factory.mktemp("m") / "m")


def _with_dtype(folder: Path, field: str, value) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg | {field: value}))
    return folder


@pytest.mark.parametrize(("value", "dtype"), [("float", torch.float32), ("half", torch.float16),
                                              ("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_torch_names_and_aliases(folder, value, dtype):
    for field in ("dtype", "torch_dtype"):
        assert resolve_model(str(_with_dtype(folder, field, value))).dtype == dtype


@pytest.mark.parametrize("value", ["auto", "fp16", "float64", 16])
def test_other_values_are_refused_by_config_field(folder, value):
    _with_dtype(folder, "torch_dtype", value)
    with pytest.raises(ConfigError) as e:
        resolve_model(str(folder))
    msg = str(e.value)
    assert str(folder / "config.json") in msg and f"torch_dtype {json.dumps(value)}" in msg
    assert "--dtype 'auto'" not in msg and "--dtype float32" in msg
    assert resolve_model(str(folder), dtype="float32").dtype == torch.float32  # --dtype decides alone
