"""The model's context as a prompt check sees it: a prompt that fills it is refused saying a prompt
needs room for one generated token ("128 tokens, the context is 128" read as if it fit)."""

from __future__ import annotations

import pytest

from moelight.errors import PromptError
from moelight.jobs.prompts import fit_to_context
from moelight.sampling.params import SamplingParams


def test_a_prompt_of_the_whole_context_says_it_needs_room_for_a_token():
    with pytest.raises(PromptError, match=r"prompt 0 has 128 tokens, the model's context is 128: a prompt may "
                                          r"have at most 127 tokens, leaving room for at least one generated token"):
        fit_to_context("prompt 0", [5] * 128, SamplingParams(max_tokens=4), 128)
    assert fit_to_context("prompt 0", [5] * 127, SamplingParams(max_tokens=4), 128).max_tokens == 1
