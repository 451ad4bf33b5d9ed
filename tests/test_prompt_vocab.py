"""A tokenizer that gives ids beyond config.json's vocab_size is not the model's: a text prompt that
reaches them is refused at the prompt check, by its line, before anything loads (it was an IndexError in
the embedding, and `moelight run` lost the good requests of the job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from moelight import LLM
from moelight.cli import app
from moelight.errors import PromptError
from tests.cli_text import says

pytest.importorskip("transformers")

from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def big_tok(tmp_path_factory) -> Path:
    """The tiny Mixtral (vocab_size 320) with a word-level tokenizer of 330 words: w325 is id 325."""
    folder = save_checkpoint(make_hf_model(seed=1), tmp_path_factory.mktemp("m") / "big_tok", byte_tokenizer=False)
    tok = Tokenizer(models.WordLevel({"<unk>": 0} | {f"w{i}": i for i in range(1, 330)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def test_llm_refuses_a_text_prompt_beyond_the_vocabulary(big_tok):
    llm = LLM(str(big_tok), dtype="float32")
    with pytest.raises(PromptError, match=r"prompt 1: the tokenizer gives token id\(s\) 325, beyond .* vocab_size 320"):
        llm.generate(["w5 w6", "w5 w325"], use_tqdm=False)


def test_llm_chat_refuses_a_conversation_beyond_the_vocabulary(big_tok):
    llm = LLM(str(big_tok), dtype="float32")
    with pytest.raises(PromptError, match=r"conversation 1: the tokenizer gives token id\(s\) 325"):
        llm.chat([[{"role": "user", "content": "w5"}], [{"role": "user", "content": "w325"}]], use_tqdm=False)


def test_run_names_the_line_and_keeps_the_good_requests(big_tok, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": k, "prompt": p}) + "\n"
                            for k, p in (("a", "w5 w6"), ("b", "w5 w325 w6"), ("c", "w7"))))
    out = tmp_path / "o.jsonl"
    args = ["run", "--dataset", str(data), "--model", str(big_tok), "--output", str(out), "--gen-len", "2",
            "--dtype", "float32", "--no-progress", "--hardware", "cpu-server"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert says(refused.output, "d.jsonl:2: the tokenizer gives token id(s) 325")
    kept = CliRunner().invoke(app, [*args, "--skip-bad-lines", "--overwrite"])
    assert kept.exit_code == 0, kept.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c"]
