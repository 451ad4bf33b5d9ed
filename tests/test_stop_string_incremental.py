"""The stop-string search reads a text grown a few tokens at a time (output_text.py), with the texts and
stop positions that decoding the whole output at every step gave, at a bounded cost per token."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from moelight.engine.sequence import Sequence
from moelight.sampling.params import SamplingParams
from moelight.tokenization.byte_tokenizer import ByteTokenizer
from moelight.tokenization.tokenizer import load_tokenizer
from tests.test_tokenizer import build_tokenizer

TEXT = "Le café coûte 3 €, 東京 は遠い; emoji 🙂 and plain words. " * 8


class WholeText:
    """The old search's text: the whole output decoded again at every step."""

    def __init__(self, decode, skip, context) -> None:
        self.decode, self.skip, self.context = decode, skip, context

    def text(self, ids: list[int]) -> str:
        return self.decode(ids, self.skip, self.context)


@pytest.fixture(scope="module", params=["stdlib", "byte", "strip"])
def tok(request, tmp_path_factory):
    if request.param == "stdlib":
        return load_tokenizer(Path(__file__).parent / "data" / "stdlib-moe")
    if request.param == "byte":
        return ByteTokenizer()
    return load_tokenizer(build_tokenizer(Path(tmp_path_factory.mktemp("strip")) / "tok"))


def outputs(tok) -> list[list[int]]:
    """A real text's tokens, and random tokens (bytes that break characters, ids of every kind)."""
    rng = random.Random(0)
    ids = tok.encode(TEXT, add_bos=False)
    return [ids, [rng.randrange(3, min(tok.vocab_size, 300)) for _ in range(400)], ids[5:] + ids[:40]]


def run(tok, ids: list[int], params: SamplingParams, whole: bool, context: list[int]) -> Sequence:
    def dec(x, skip, ctx=()):
        return tok.decode(x, skip, ctx)

    seq = Sequence(0, 10, params, context=context)
    if whole:
        seq.grown = WholeText(dec, params.skip_special_tokens, context)
    for t in ids:
        if seq.append(t, set(), dec):
            break
    return seq


def test_texts_and_stops_are_those_of_whole_decodes(tok):
    rng = random.Random(1)
    context = tok.encode("The prompt says:", add_bos=False)[-6:]
    for ids in outputs(tok):
        text = tok.decode(ids, True, context)
        for _ in range(6):  # stop strings cut out of the text, across token boundaries and inside characters
            at = rng.randrange(0, max(1, len(text) - 12))
            stops = [text[at:at + rng.randrange(1, 12)], "never occurs \u2603"]
            for include in (False, True):
                p = SamplingParams(max_tokens=10**6, ignore_eos=True, stop=stops, include_stop_str_in_output=include,
                                   min_tokens=rng.choice([0, 0, 30]))
                new, old = run(tok, ids, p, False, context), run(tok, ids, p, True, context)
                assert (new.text, new.stop_reason, len(new.out), new.finish) == \
                    (old.text, old.stop_reason, len(old.out), old.finish)


def test_the_cost_per_token_is_bounded(tok):
    """Text without adjacent multi-byte characters: a byte-fallback decoder shows a run of byte tokens as
    U+FFFD each until its last character completes, so such steps decode the whole output, as before."""
    decoded = []

    def dec(x, skip, ctx=()):
        decoded.append(len(x))
        return tok.decode(x, skip, ctx)

    ids = (tok.encode("Le café coûte 3 €, plain words; emoji 🙂 too. ", add_bos=False) * 200)[:2000]
    seq = Sequence(0, 10, SamplingParams(max_tokens=10**6, ignore_eos=True, stop=["never occurs \u2603"]))
    for t in ids:
        seq.append(t, set(), dec)
    assert seq.text == tok.decode(ids, True)
    assert sum(decoded) < 40 * len(ids)  # it was the square: every step decoded the whole output
