"""`--model org/name` runs a model from the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub), as
vLLM does offline; one that is not there is refused saying where moelight looked and what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moelight.errors import ConfigError
from moelight.loading.model_source import resolve_model

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A Hub cache holding org/tiny at COMMIT (files copied where the Hub links them: enough here)."""
    root = tmp_path_factory.mktemp("hub")
    src = save_checkpoint(make_hf_model(seed=4), root / "src")
    repo = root / "hub" / "models--org--tiny"
    shutil.copytree(src, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


def test_a_hub_id_resolves_to_its_cached_snapshot(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub))
    assert resolve_model("org/tiny").model_dir == hub / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "hub"))
    monkeypatch.setenv("HF_HOME", str(hub / "elsewhere"))
    assert resolve_model("org/tiny").config.num_layers == 2


def test_a_hub_id_not_in_the_cache_says_where_it_looked(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "hub"))
    with pytest.raises(ConfigError) as e:
        resolve_model("org/other")
    msg = str(e.value)
    assert "not in the Hugging Face cache" in msg and str(hub / "hub" / "models--org--other") in msg
    assert "hf download org/other" in msg
