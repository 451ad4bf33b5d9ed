"""vLLM's `LLM(...)` arguments that moelight spells otherwise are taken in vLLM's meaning
(api/vllm_arguments.py): a vLLM script's constructor call works unchanged."""

from __future__ import annotations

import pytest
import torch

from moelight import LLM, SamplingParams
from moelight.engine.options import EngineOptions, OptionError

TINY = {"load_format": "dummy", "dtype": "float32", "hardware": "cpu-server"}


def test_seed_none_is_seed_0_as_in_vllms_v1_engine():
    """vLLM's V1 engine takes seed=None as 0 (and warns); it must never crash a later generate."""
    sampled = SamplingParams(max_tokens=4, temperature=1.0)
    with pytest.warns(UserWarning, match="seed=None.*seed=0"):
        unseeded = LLM("tiny", seed=None, **TINY)
    assert unseeded.options.seed == 0
    got = [o.outputs[0].token_ids for o in unseeded.generate(["Hello", "Hi"], sampled)]
    assert got == [o.outputs[0].token_ids for o in LLM("tiny", seed=0, **TINY).generate(["Hello", "Hi"], sampled)]
    with pytest.raises(OptionError, match="--seed '3': a whole number"):
        EngineOptions(model="tiny", seed="3").validate()


def test_tokenizer_is_a_folder_as_in_vllm(tmp_path):
    """vLLM's `tokenizer` is a path: the tokenizer loads from that folder, as a model folder's does; a value
    that is neither a folder nor a moelight choice is refused in those terms."""
    from tests.test_tokenizer import build_tokenizer

    folder = build_tokenizer(tmp_path / "tok")
    llm = LLM("tiny", tokenizer=str(folder), **TINY)
    assert type(llm.tokenizer).__name__ == "HFTokenizer" and llm.tokenizer.model_dir == folder
    out = llm.generate("hello world", SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("hello world")
    with pytest.raises(OptionError, match="'org/name' is neither a folder nor one of .*auto, hf, byte, none"):
        LLM("tiny", tokenizer="org/name", **TINY)


@pytest.mark.parametrize("dtype, name", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                         (torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_vllms_dtype_names_and_torch_dtypes_are_taken(dtype, name):
    llm = LLM("tiny", **(TINY | {"dtype": dtype}))
    assert llm.options.dtype == name and llm.session.dtype_name == name


def test_a_torch_dtype_moelight_does_not_run_is_refused_by_its_name():
    with pytest.raises(OptionError, match="--dtype 'float64' is not one of"):
        LLM("tiny", **(TINY | {"dtype": torch.float64}))


@pytest.mark.parametrize("given", [{"quantization": None}, {"tensor_parallel_size": 1},
                                   {"quantization": None, "tensor_parallel_size": 1}])
def test_vllms_no_op_defaults_are_taken(given):
    """`quantization=None` and `tensor_parallel_size=1`, as vLLM's examples pass them, ask for what moelight
    does anyway: they are taken, where other values stay refused with moelight's name for them."""
    llm = LLM("tiny", **(TINY | given))
    assert llm.options.quantize == "none" and llm.options.gpus is None


@pytest.mark.parametrize("given, needle", [
    ({"tensor_parallel_size": 2}, "vLLM's tensor_parallel_size is moelight's gpus"),
    ({"tensor_parallel_size": True}, "vLLM's tensor_parallel_size is moelight's gpus"),
    ({"quantization": "awq"}, "vLLM's quantization is moelight's quantize"),
    ({"max_num_batched_tokens": 4096}, "vLLM's max_num_batched_tokens is moelight's max_prefill_tokens"),
])
def test_other_values_are_refused_with_moelights_name(given, needle):
    """vLLM's max_num_batched_tokens is a per-step budget of decode and prompt tokens that splits a long prompt;
    moelight's max_prefill_tokens counts prompt tokens per prefill pass only, so it is named, not taken."""
    with pytest.raises(OptionError, match=needle):
        LLM("tiny", **(TINY | given))
