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


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_take_a_hub_id_too(hub, monkeypatch, command):
    from typer.testing import CliRunner

    from moelight.cli import app
    from tests.cli_text import says

    monkeypatch.setenv("HF_HUB_CACHE", str(hub / "hub"))
    extra = ["--gen-len", "4", "--prompt-len", "8"]
    ok = CliRunner().invoke(app, [command, "--model", "org/tiny", "--hardware", "t4", *extra])
    assert ok.exit_code == 0, ok.output
    missing = CliRunner().invoke(app, [command, "--model", "org/other", "--hardware", "t4", *extra])
    assert missing.exit_code == 2 and says(missing.output, "not in the Hugging Face cache"), missing.output
