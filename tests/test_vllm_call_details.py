"""Details of vLLM's offline API a ported script may rely on: what `generate` fills under
`detokenize=False`, a `use_tqdm` factory, the tokenizer's `convert_ids_to_tokens`,
`truncate_prompt_tokens`, SamplingParams' `from_optional` / `clone`, the outputs' `finished()`,
`num_cached_tokens` and `metrics`, and what `llm_engine` points to."""

from __future__ import annotations

import pytest

from moelight import LLM, SamplingParams
from moelight.api.outputs import CompletionOutput

PROMPTS = ["Tell me about cats.", "Hi"]


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")


def test_detokenize_false_leaves_text_and_decoded_tokens_empty(tiny):
    """vLLM: token ids only, the text empty and every Logprob's decoded_token None (prompt ones too)."""
    kw = dict(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1)
    plain = tiny.generate(PROMPTS[0], SamplingParams(**kw))[0]
    bare = tiny.generate(PROMPTS[0], SamplingParams(detokenize=False, **kw))[0]
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids and bare.outputs[0].text == ""
    assert all(v.decoded_token is None for d in bare.outputs[0].logprobs for v in d.values())
    assert all(v.decoded_token is None for d in bare.prompt_logprobs[1:] for v in d.values())
    assert all(v.decoded_token is not None for d in plain.outputs[0].logprobs for v in d.values())


def test_use_tqdm_may_be_a_tqdm_factory(tiny):
    """vLLM calls a callable use_tqdm to make the progress bar."""
    from tqdm import tqdm

    bars = []

    def factory(**kw):
        bars.append(tqdm(mininterval=3600, **kw))
        return bars[-1]

    tiny.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=factory)
    assert len(bars) == 1 and bars[0].total == bars[0].n == len(PROMPTS)


def test_convert_ids_to_tokens_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.test_tokenizer import build_tokenizer

    folder = build_tokenizer(tmp_path / "tok")
    tok = LLM("tiny", load_format="dummy", hardware="cpu-server", tokenizer=str(folder)).get_tokenizer()
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.encode("Hello world, café")
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_ids_to_tokens(ids, skip_special_tokens=True) == ref.convert_ids_to_tokens(
        ids, skip_special_tokens=True) and tok.convert_ids_to_tokens(ids[1]) == ref.convert_ids_to_tokens(ids[1])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny):
    """vLLM's left truncation: the last k prompt tokens; -1 is max_model_len; 0, < -1 or past the context
    are refused."""
    ids = tiny.tokenizer.encode(PROMPTS[0])
    greedy = dict(max_tokens=3, temperature=0.0)
    cut = tiny.generate(PROMPTS[0], SamplingParams(truncate_prompt_tokens=4, **greedy))[0]
    assert cut.prompt_token_ids == ids[-4:] and cut.outputs[0].token_ids == tiny.generate(
        [ids[-4:]], SamplingParams(**greedy))[0].outputs[0].token_ids
    whole = tiny.generate(PROMPTS[0], SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert whole.prompt_token_ids == ids
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1"):
            SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="above max_model_len"):
        tiny.generate("hi", SamplingParams(truncate_prompt_tokens=tiny.max_model_len + 1))


def test_from_optional_reads_none_as_the_default_and_clamps_logit_bias():
    """vLLM's from_optional (what its OpenAI server builds from a request): None for n, the penalties,
    temperature, top_p or stop_token_ids is the default; logit_bias keys become ints, biases clamp to +-100."""
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, presence_penalty=None,
                                     frequency_penalty=None, repetition_penalty=None, stop_token_ids=None,
                                     max_tokens=5, seed=None, logit_bias={"7": 250, 9: -3.5})
    assert p == SamplingParams(max_tokens=5, logit_bias={7: 100.0, 9: -3.5})
    with pytest.raises(TypeError, match="logit_bias must map token ids to numbers"):
        SamplingParams.from_optional(logit_bias={"x": 1})


def test_clone_is_a_deep_copy():
    p = SamplingParams(stop=["a"], stop_token_ids=[5], max_tokens=3)
    q = p.clone()
    q.stop.append("b")
    q.stop_token_ids.append(6)
    assert q is not p and p.stop == ["a"] and p.stop_token_ids == [5]


def test_outputs_say_finished_cached_tokens_and_no_metrics():
    """CompletionOutput.finished() as vLLM's; RequestOutput.num_cached_tokens counts the prompt tokens served
    from the prefix cache (0 without it), metrics is None as in vLLM's offline LLM (stats off)."""
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    prompts = [shared + "Cats?", shared + "Dogs?"]
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    cached = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server").generate(prompts, greedy)
    plain = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server",
                enable_prefix_caching=False).generate(prompts, greedy)
    assert [o.num_cached_tokens for o in plain] == [0, 0] and cached[0].num_cached_tokens == 0
    assert 0 < cached[1].num_cached_tokens < len(cached[1].prompt_token_ids)
    assert all(o.metrics is None and o.finished and o.outputs[0].finished() for o in cached)
    assert not CompletionOutput(0, "", [], None).finished()


def test_llm_engine_says_what_to_use_instead(tiny):
    with pytest.raises(AttributeError, match="no separate engine object; use llm.get_tokenizer"):
        tiny.llm_engine.get_tokenizer()
    assert not hasattr(tiny, "llm_engine")
