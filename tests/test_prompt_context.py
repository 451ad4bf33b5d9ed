"""The model's context as a prompt check sees it: config.json's max_position_embeddings stretched by
its RoPE scaling as vLLM derives max_model_len (the context stayed max_position_embeddings), and a
prompt that fills it refused saying a prompt needs room for one generated token ("128 tokens, the
context is 128" read as if it fit)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moelight.errors import PromptError
from moelight.jobs.prompts import fit_to_context
from moelight.loading.presets import preset_config
from moelight.models.context_length import context_length
from moelight.planning.held_model import held_model_spec
from moelight.sampling.params import SamplingParams


def _items(**p) -> tuple:
    return tuple(sorted(p.items()))


@pytest.mark.parametrize("scaling, context", [
    ((), 4096),
    (_items(rope_type="linear", factor=4.0), 4 * 4096),
    (_items(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768), 131072),  # Qwen3's card recipe
    (_items(rope_type="yarn", factor=4.0, original_max_position_embeddings=512), 2048),  # below max_position: vLLM's
    (_items(rope_type="yarn", factor=2.0), 2 * 4096),  # no original: max_position_embeddings, as transformers reads it
    (_items(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=512), 4096),  # already the scaled context
])
def test_the_context_is_stretched_as_vllm_derives_max_model_len(scaling, context):
    assert context_length(4096, scaling) == context


def test_the_plan_checks_a_workload_against_the_stretched_context():
    cfg = replace(preset_config("tiny"), max_position_embeddings=40,
                  rope_scaling=_items(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))
    assert cfg.context_length == 128 and held_model_spec(cfg).max_position == 128


def test_a_prompt_of_the_whole_context_says_it_needs_room_for_a_token():
    with pytest.raises(PromptError, match=r"prompt 0 has 128 tokens, the model's context is 128: a prompt may "
                                          r"have at most 127 tokens, leaving room for at least one generated token"):
        fit_to_context("prompt 0", [5] * 128, SamplingParams(max_tokens=4), 128)
    assert fit_to_context("prompt 0", [5] * 127, SamplingParams(max_tokens=4), 128).max_tokens == 1
