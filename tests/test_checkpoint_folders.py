"""A model folder that is not whole says what it lacks and what to do: an interrupted Hugging Face download
(links in snapshots/<hash>/ to blobs still `.incomplete`) and a folder of PyTorch pickles only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moelight import LLM
from moelight.cli import app
from moelight.errors import WeightsError
from tests.cli_text import says

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=3)


def as_interrupted_download(src: Path, root: Path, cut: str) -> Path:
    """`src` laid out as the Hub cache lays it out, its blob `cut` never finished."""
    snap, blobs = root / "snapshots" / "abc", root / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in src.iterdir():
        shutil.copy(f, blobs / f.name)
        os.symlink(os.path.relpath(blobs / f.name, snap), snap / f.name)
    (blobs / cut).rename(blobs / (cut + ".incomplete"))
    return snap


def test_interrupted_single_file_download(hf_model, tmp_path):
    src = save_checkpoint(hf_model, tmp_path / "src")
    snap = as_interrupted_download(src, tmp_path / "hub", "model.safetensors")
    with pytest.raises(WeightsError) as e:
        LLM(str(snap), dtype="float32")
    msg = str(e.value)
    assert str(snap / "model.safetensors") in msg and "the download is incomplete" in msg


def test_interrupted_sharded_download_in_a_run(hf_model, tmp_path):
    src = save_checkpoint(hf_model, tmp_path / "src", shards=3)
    snap = as_interrupted_download(src, tmp_path / "hub", "model-00002-of-00003.safetensors")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(snap), "--output",
                                      str(tmp_path / "o.jsonl"), "--no-progress", "--hardware", "cpu-server"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert says(result.output, "model-00002-of-00003.safetensors") and says(result.output, "download is incomplete")


@pytest.mark.parametrize("cut,error", [("config.json", "ConfigError"), ("tokenizer.json", "TokenizerError")])
def test_interrupted_download_of_config_or_tokenizer(hf_model, tmp_path, cut, error):
    """Not 'config.json: not found' / 'no tokenizer.json' for a file the folder links to: the download
    is incomplete, and the message says so."""
    import moelight.errors

    src = save_checkpoint(hf_model, tmp_path / "src", byte_tokenizer=False)
    (src / "tokenizer.json").write_text("{}")  # present in the repository; cut below when it is the one
    snap = as_interrupted_download(src, tmp_path / "hub", cut)
    with pytest.raises(getattr(moelight.errors, error), match=f"{cut}: a link to .*the download is incomplete"):
        LLM(str(snap), dtype="float32")


def test_pytorch_bin_only_folder_says_how_to_convert(hf_model, tmp_path):
    folder = save_checkpoint(hf_model, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(WeightsError) as e:
        LLM(str(folder), dtype="float32")
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "does not read" in msg and "save_pretrained" in msg
