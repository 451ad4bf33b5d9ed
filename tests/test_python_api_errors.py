"""The Python API's errors and warnings: clear types and messages for bad calls, nothing for nothing,
and the cuts it makes to fit the context said as a warning and in `last_report` (the CLI's side of
these is tests/test_job_files.py)."""

from __future__ import annotations

import pytest

from moelight.errors import PromptError


@pytest.fixture(scope="module")
def tiny_llm():
    from moelight import LLM

    return LLM("tiny", load_format="dummy", hardware="cpu-server")


@pytest.mark.parametrize("call, error, needle", [
    (lambda llm, sp: sp(max_tokens="ten"), TypeError, "max_tokens must be an int, got str"),
    (lambda llm, sp: llm.generate(None), TypeError, "prompts must be"),
    (lambda llm, sp: llm.chat("hello"), TypeError, "conversations must be a list"),
    (lambda llm, sp: llm.chat([{"role": "bot", "content": "hi"}]), ValueError, "role must be one of .*got 'bot'"),
    (lambda llm, sp: llm.generate("hi", {"max_tokens": 2}), TypeError, "sampling_params must be"),
    # a bool is an int in Python, never a token id
    (lambda llm, sp: llm.generate([[True, 5]]), PromptError, "prompt 0: prompt_token_ids must be .*; got True"),
    (lambda llm, sp: llm.generate({"prompt_token_ids": [5, False]}), PromptError, "got False"),
    (lambda llm, sp: sp(logit_bias={True: 5.0}), TypeError, "logit_bias keys must be token ids"),
    (lambda llm, sp: sp(stop_token_ids=[True]), TypeError, "stop_token_ids must be a list of ints"),
    (lambda llm, sp: sp(allowed_token_ids=[1, False]), TypeError, "allowed_token_ids must be a list of ints"),
])
def test_the_python_api_raises_clear_type_and_value_errors(tiny_llm, call, error, needle):
    from moelight import SamplingParams

    with pytest.raises(error, match=needle):
        call(tiny_llm, SamplingParams)


def test_the_python_api_returns_nothing_for_nothing(tiny_llm):
    assert tiny_llm.generate([]) == [] and tiny_llm.chat([]) == []


def test_the_python_api_says_when_it_cuts_max_tokens_and_min_tokens_to_the_context(tiny_llm):
    from moelight import SamplingParams

    ctx = tiny_llm.config.max_position_embeddings
    with pytest.warns(UserWarning, match="max_tokens cut so prompt"):
        out = tiny_llm.generate(["x" * (ctx - 6)], SamplingParams(max_tokens=50, min_tokens=50, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == ctx - len(out[0].prompt_token_ids)
    assert tiny_llm.last_report.warnings["counts"] == {"max_tokens_cut": 1}


def test_max_model_len_above_the_models_context_is_refused():
    """As vLLM refuses it: the model has no positions past its context."""
    from moelight import LLM
    from moelight.engine.options import OptionError

    with pytest.raises(OptionError, match=r"max_model_len 100000 is above the model's context, \d+ tokens"):
        LLM("tiny", load_format="dummy", hardware="cpu-server", max_model_len=100000)
