"""generation_config.json as vLLM reads it: its end ids end generation whatever the tokenizer (the byte
tokenizer, skip_tokenizer_init), and its sampling fields are the defaults of `get_default_sampling_params()`
and of generate() without SamplingParams under `generation_config="auto"`; "vllm" turns them off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelight import LLM, SamplingParams
from moelight.errors import ConfigError

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402

PROMPT = [5, 17, 33, 60]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny Mixtral (byte tokenizer), with a generation_config.json ending on its 3rd greedy token."""
    folder = save_checkpoint(make_hf_model(seed=0), tmp_path_factory.mktemp("m") / "m")
    plain = LLM(str(folder), dtype="float32", hardware="cpu-server")
    third = plain.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0].token_ids[2]
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [2, third], "temperature": 0.5, "top_k": 7, "top_p": 0.9, "max_new_tokens": 5}))
    return folder


@pytest.mark.parametrize("kw", [{}, {"skip_tokenizer_init": True}], ids=["byte-tokenizer", "no-tokenizer"])
def test_generation_config_end_ids_end_generation(folder, kw):
    """... and name themselves as stop_reason: vLLM lists the file's end ids beside the tokenizer's EOS
    among the stop_token_ids."""
    llm = LLM(str(folder), dtype="float32", hardware="cpu-server", **kw)
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "stop" and out.stop_reason == out.token_ids[-1]


def test_sampling_defaults_auto_and_vllm(folder):
    llm = LLM(str(folder), dtype="float32", hardware="cpu-server")
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.5, 7, 0.9, 5)
    out = llm.generate([{"prompt_token_ids": PROMPT}])[0].outputs[0]  # no SamplingParams: the defaults
    assert len(out.token_ids) <= 5
    off = LLM(str(folder), dtype="float32", hardware="cpu-server", generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()


def test_generation_config_from_another_folder(folder, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 3}))
    llm = LLM("tiny", load_format="dummy", hardware="cpu-server", generation_config=str(tmp_path))
    assert (llm.get_default_sampling_params().temperature, llm.get_default_sampling_params().top_k) == (0.25, 3)
    with pytest.raises(ConfigError, match="no generation_config.json there"):
        LLM("tiny", load_format="dummy", hardware="cpu-server", generation_config=str(tmp_path / "none"))


def test_moelight_run_names_the_defaults_it_does_not_take(folder, tmp_path):
    """The CLI's own options decide its sampling (greedy by default, as the job record holds them); a
    generation_config.json whose sampling vLLM would take is named in the report, so none goes unseen."""
    from typer.testing import CliRunner

    from moelight.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(folder), "--output", str(out),
                                   "--gen-len", "4", "--dtype", "float32", "--no-progress"])
    assert res.exit_code == 0, res.output
    notes = json.loads((tmp_path / "o.jsonl.report.json").read_text())["notes"]
    assert any("generation_config.json suggests temperature 0.5, top_k 7, top_p 0.9, max_tokens 5" in n
               for n in notes), notes
