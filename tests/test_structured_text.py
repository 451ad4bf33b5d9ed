"""Structured outputs write valid text: UTF-8 whole (the grammar matches bytes), no special token inside a
string, a choice of any characters, and no schema keyword the grammar would not enforce."""

from __future__ import annotations

import codecs
import json
import random
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("xgrammar")

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.sampling.params import StructuredOutputsParams as SO  # noqa: E402
from moelight.sampling.schema_checks import StructuredOutputError, check_schema_keywords  # noqa: E402
from moelight.sampling.utf8_guard import BAD, STATES, allowed_bits, token_transitions  # noqa: E402

STDLIB_MOE = Path(__file__).parent / "data" / "stdlib-moe"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")


def _valid_prefix(data: bytes) -> bool:
    """Some completion makes `data` valid UTF-8 (Python's incremental decoder waits on a truncated
    surrogate form such as ED A0, so each class of second byte is tried, then plain continuations)."""
    for ending in [b""] + [bytes([second]) + b"\x80" * k for second in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
                           for k in range(3)]:
        try:
            codecs.decode(data + ending, "utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def test_the_guard_admits_exactly_the_tokens_that_keep_the_text_utf8():
    """Random walks over every single byte and some multi-byte tokens: the guard allows a token iff the
    text with it is still a prefix of valid UTF-8 (surrogates, overlong forms and stray continuations out)."""
    rng = random.Random(0)
    vocab = [bytes([b]) for b in range(256)] + ["é".encode(), "🙂".encode(), b"\xed\xa0", b"\xe0\x80", b"\xf0\x9f",
                                                b"\x98\x82", b"", b"ab\xc3"]
    transitions = token_transitions(vocab)
    for _ in range(200):
        text, state = b"", 0
        for _ in range(12):
            allowed = [t for t in range(len(vocab)) if transitions[state, t] != BAD]
            assert allowed == [t for t in range(len(vocab)) if _valid_prefix(text + vocab[t])]
            token = rng.choice(allowed)
            text, state = text + vocab[token], int(transitions[state, token])
    # packed as xgrammar packs a token bitmask: bit j of word i is token 32 i + j
    bits = allowed_bits(transitions)
    for state in range(STATES):
        unpacked = [t for t in range(len(vocab)) if (int(bits[state, t // 32]) >> (t % 32)) & 1]
        assert unpacked == [t for t in range(len(vocab)) if transitions[state, t] != BAD]


def test_pattern_strings_come_out_as_characters_that_validate(llm):
    """A `[^x]` class admitted UTF-8-encoded surrogates: outputs that stopped held U+FFFD runs that broke
    the pattern's length (about a fifth of them on this model)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[^x]{1,12}$"}},
              "required": ["s"], "additionalProperties": False}
    outs = llm.generate([f"q{i}" for i in range(32)],
                        SamplingParams(n=2, temperature=0.0, seed=1, max_tokens=40, structured_outputs=SO(json=schema)))
    for c in (c for o in outs for c in o.outputs):
        value = json.loads(c.text)["s"]
        assert c.finish_reason == "stop" and re.fullmatch(r"[^x]{1,12}", value) and "\ufffd" not in value, c.text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_choice_outside_the_basic_plane_is_written_as_itself(llm, temperature):
    choices = ["🙂", "𝔸bc"]
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=12, structured_outputs=SO(choice=choices))
    outs = llm.generate([f"pick {i}" for i in range(4)], params)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs), outs


@pytest.mark.parametrize("schema, needle", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at its root"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}]}}}, "allOf at /properties/a"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"$defs": {"x": {"type": "object", "minProperties": 1}}, "$ref": "#/$defs/x"}, "minProperties at /$defs/x"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "required b (not among its properties)"),
    # parsed by xgrammar, then ignored
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength beside pattern at its root"),
    ({"type": "string", "format": "email", "minLength": 5}, "minLength beside format"),
    ({"type": "string", "format": "date", "pattern": "^1"}, "pattern beside format"),
    ({"type": "string", "format": "phone"}, "format 'phone'"),
    ({"type": "string", "enum": ["abc", "d"], "maxLength": 1}, "maxLength beside enum"),
    ({"type": "string", "enum": ["a", 1]}, "type beside enum"),
    ({"const": 5, "minimum": 6}, "minimum beside const"),
    ({"$defs": {"t": {"type": "string"}}, "properties": {"s": {"$ref": "#/$defs/t", "maxLength": 3}}},
     "maxLength beside $ref at /properties/s"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
     "type beside anyOf, properties beside anyOf"),
    ({"properties": {"a": {"$ref": "https://example.com/s.json"}}}, "$ref 'https://example.com/s.json'"),
    ({"$defs": {"x": {"$anchor": "X", "type": "integer"}}, "$ref": "#X"}, "$ref '#X'"),
    ({"type": "string", "pattern": "^(?!abc)[a-z]{3}$"}, "Lookahead is not supported"),
    ({"type": "string", "pattern": "a^b"}, "an anchor ^ or $ inside it"),
    ({"maxLength": 3}, "maxLength without a type"),
    ({"$dynamicRef": "#meta"}, "$dynamicRef"),
])
def test_schema_keywords_the_grammar_cannot_enforce_are_refused(llm, schema, needle):
    with pytest.raises(StructuredOutputError, match=re.escape(needle)):
        check_schema_keywords(schema)
    with pytest.raises(ValueError, match="cannot enforce"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=SO(json=schema)))
    check_schema_keywords({"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": ["allOf"]}}})


@pytest.mark.parametrize("schema", [
    {"type": "string", "enum": ["a", "b"], "description": "x"}, {"type": ["integer", "null"], "enum": [1, None]},
    {"$ref": "#/$defs/t", "title": "T", "$defs": {"t": {"type": "string", "maxLength": 3}}},
    {"anyOf": [{"type": "string", "pattern": "^(a|^b)[^^$]$"}, {"type": "null"}], "default": None},
    {"type": "string", "format": "date-time"}, {"type": "string", "minLength": 1, "maxLength": 3},
    {"properties": {"a": {"type": "integer", "minimum": 0}}, "minLength": 2}, {"items": {"const": 1}},
    {"type": "integer", "maxLength": 2, "minimum": 0}, {"$ref": "#"}, True,
])
def test_schema_keywords_the_grammar_enforces_stay_accepted(schema):
    check_schema_keywords(schema)


def test_a_special_token_is_never_part_of_a_string():
    """skip_special_tokens drops it from the text: inside a string it would make the text break the schema."""
    llm = LLM(str(STDLIB_MOE), dtype="float32")
    special = [i for i, t in llm.tokenizer.backend.get_added_tokens_decoder().items() if t.special]
    c = llm.session.sampling.grammars.constraint(SO(json={
        "type": "object", "properties": {"s": {"type": "string", "minLength": 3}}, "required": ["s"]}))
    for t in llm.tokenizer.encode('{"s": "', add_bos=False):
        assert c.accept(t)
    row = torch.zeros(llm.config.vocab_size)
    c.mask(row)
    assert special and all(torch.isinf(row[i]) for i in special if i not in llm.session.eos), special


def test_a_boolean_schema_true_is_any_json_value_and_false_is_refused(llm):
    """JSON Schema's (and vLLM's) reading of a boolean schema."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=30, structured_outputs=SO(json=True))
    for out in (o.outputs[0] for o in llm.generate(["x", "y"], params)):
        if out.finish_reason == "stop":
            json.loads(out.text)  # any JSON value parses
    with pytest.raises(ValueError, match="request 0: .*Schema 'false' cannot accept any value"):
        llm.generate(["x"], SamplingParams(max_tokens=3, structured_outputs=SO(json=False)))
