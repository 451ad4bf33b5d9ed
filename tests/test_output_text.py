"""An output's text as vLLM's detokenizer gives it: read after its prompt (a SentencePiece Strip decoder
drops the first space of a whole text only), and no half character at its end."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelight import LLM, SamplingParams
from moelight.sampling.params import StructuredOutputsParams as SO
from tests.checkpoints import make_hf_model, save_checkpoint
from tests.test_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def sp_llm(tmp_path_factory) -> LLM:
    """A tiny Mixtral with a Llama-style byte-fallback tokenizer (decoder ends in Strip(left=1))."""
    folder = Path(tmp_path_factory.mktemp("sp")) / "model"
    probe = build_tokenizer(folder.parent / "tok")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(probe / "tokenizer.json")).get_vocab_size()
    save_checkpoint(make_hf_model(seed=2, vocab_size=vocab, hidden_size=64, intermediate_size=96), folder,
                    byte_tokenizer=False)
    build_tokenizer(folder)
    return LLM(str(folder), dtype="float32")


def test_an_output_keeps_the_space_it_begins_with(sp_llm):
    pytest.importorskip("xgrammar")
    tok = sp_llm.tokenizer
    params = SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=8, logprobs=0,
                            structured_outputs=SO(choice=[" yes", " no"]))
    outs = sp_llm.generate(["Hello", "Café"], params)
    for o in outs:
        for c in o.outputs:
            assert c.text in (" yes", " no") and c.finish_reason == "stop", c
            ids = o.prompt_token_ids + c.token_ids[:-1]  # less the EOS that ended it
            assert c.text == tok.decode(ids)[len(tok.decode(o.prompt_token_ids)):]
            first = c.logprobs[0][c.token_ids[0]].decoded_token
            assert first.startswith(" "), first  # a logprob's token keeps its space too
    stopped = sp_llm.generate(["Hello"], SamplingParams(max_tokens=8, stop=["no"], include_stop_str_in_output=True,
                                                        structured_outputs=SO(choice=[" no"])))
    assert stopped[0].outputs[0].text == " no" and stopped[0].outputs[0].stop_reason == "no"


def test_an_output_cut_inside_a_character_leaves_it_out():
    """The byte tokenizer writes 🙂 in four tokens: the regex asks for two at least, and max_tokens 6 cuts
    the second after two bytes."""
    pytest.importorskip("xgrammar")
    llm = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")
    params = SamplingParams(max_tokens=6, structured_outputs=SO(regex="(🙂|🙃){2,}x"))
    out = llm.generate(["x"], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text in ("🙂", "🙃"), out
