"""Structured outputs: a grammar (JSON schema, any JSON object, regex, a choice, EBNF) as a token mask
on every step's logits, with xgrammar (the engine vLLM and SGLang use: a compiled grammar's token
masks are precomputed for most states, so a step costs a bitmask fill, not a vocabulary walk).

Each distinct constraint compiles once per tokenizer and is cached; each constrained sequence gets
its own matcher, advanced with every sampled token. A sequence whose grammar is complete ends with
finish_reason "stop". xgrammar is an optional extra: `pip install -e ".[structured]"`.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

import torch

from moelight.sampling.params import StructuredOutputsParams
from moelight.sampling.schema_checks import StructuredOutputError, check_schema_keywords, regex_problem
from moelight.sampling.utf8_guard import Utf8Guard, allowed_bits, token_transitions


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise StructuredOutputError('structured outputs need xgrammar: pip install -e ".[structured]" '
                                    '(or pip install xgrammar)') from None
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int, stop_ids):
    """xgrammar's view of a moelight tokenizer: every id's bytes or token string and how to read them."""
    xgr = _xgr()
    stops = sorted(stop_ids) or None
    backend = getattr(tokenizer, "backend", None)
    if backend is None:  # the byte-level tokenizer: ids OFFSET.. are the 256 bytes, the rest read as nothing
        offset, size = tokenizer.OFFSET, tokenizer.SIZE
        vocab = [bytes([i - offset]) if offset <= i < size else b"" for i in range(vocab_size)]
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    vocab = [""] * vocab_size
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size and idx not in special:  # a special token reads as no text: never in a string
            vocab[idx] = token
    kind, prefix_space = _vocab_type(json.loads(backend.to_str()))
    return xgr.TokenizerInfo(vocab, getattr(xgr.VocabType, kind), vocab_size=vocab_size, stop_token_ids=stops,
                             add_prefix_space=prefix_space)


def _vocab_type(spec: dict) -> tuple[str, bool]:
    """How a tokenizer.json spells its tokens: GPT-2's byte-level alphabet, SentencePiece's byte
    fallback (<0x0A>) with ▁ for spaces, or raw strings; and whether a leading space is added."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in types:
        return "BYTE_LEVEL", False
    if "ByteFallback" in types:
        text = json.dumps(spec.get("normalizer")) + json.dumps(spec.get("pre_tokenizer"))
        prefix = '"Prepend"' in text or ('"Metaspace"' in text and '"never"' not in text)
        return "BYTE_FALLBACK", prefix
    return "RAW", False


# xgrammar 0.2.8 spells a length-bounded JSON string's characters as [^"\\\r\n], which admits raw
# control characters that JSON forbids (RFC 8259 section 7) and its unbounded strings exclude; the
# UTF-8 encodings of surrogates (not characters) go too. (Byte sequences above U+10FFFF still pass
# its byte-level matcher: a byte-level vocabulary on random weights can draw them.)
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'


def json_schema_grammar(schema: str) -> str:
    """The schema's grammar as EBNF, every string character a JSON string character (compact whitespace:
    an object ends sooner)."""
    text = str(_xgr().Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)


class GrammarCache:
    """Compiled grammars of one tokenizer, each distinct constraint compiled once."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids) -> None:
        xgr = _xgr()
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self._compile = lru_cache(maxsize=4096)(self._compile_uncached)  # a job of many schemas: each once
        self._startable: set[tuple] = set()
        self._transitions = token_transitions(self.info.decoded_vocab)
        self._utf8_bits = allowed_bits(self._transitions)

    def _compile_uncached(self, key: tuple):
        schema, regex, choice, grammar, json_object = key
        try:
            if schema is not None:
                check_schema_keywords(json.loads(schema))
                return self.compiler.compile_grammar(json_schema_grammar(schema))
            if json_object:  # a JSON object, as OpenAI's json_object mode and vLLM promise (not any value)
                return self.compiler.compile_grammar(json_schema_grammar('{"type": "object"}'))
            if regex is not None:
                if why := regex_problem(regex):
                    raise StructuredOutputError(f"the structured-output constraint does not compile: {why}")
                return self.compiler.compile_regex(regex)
            if choice is not None:
                # EBNF string literals: " and \ escaped, every other character as it is (a \ud83d\ude42
                # surrogate pair would read as two code points)
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)
                return self.compiler.compile_grammar(f"root ::= {alternatives}")
            return self.compiler.compile_grammar(grammar)
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own errors for bad input
            why = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip())  # xgrammar's log prefix
            raise StructuredOutputError(f"the structured-output constraint does not compile: {why}") from None

    def constraint(self, params: StructuredOutputsParams) -> Constraint:
        return Constraint(self._compile(params.key()), self.vocab_size, Utf8Guard(self._transitions, self._utf8_bits))

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile now (a bad schema or regex is an error before any model loads), and refuse a constraint
        that no token can start (a regex of an empty character class): masked to nothing, the sampler would
        emit tokens that break it."""
        key = params.key()
        if key in self._startable:
            return
        if not Constraint(self._compile(key), self.vocab_size).can_start():
            raise StructuredOutputError("the structured-output constraint matches no text that this tokenizer's "
                                        "tokens can begin (no token is allowed first); check the regex, grammar or "
                                        "schema")
        self._startable.add(key)


class Constraint:
    """One sequence's grammar state: masks the logits, follows the sampled tokens."""

    def __init__(self, compiled, vocab_size: int, utf8: Utf8Guard | None = None) -> None:
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self.utf8 = utf8

    def mask(self, row: torch.Tensor) -> None:
        """Tokens the grammar does not allow next, or that would leave the text no valid UTF-8, become
        -inf in this row of logits."""
        xgr = _xgr()
        self.matcher.fill_next_token_bitmask(self.bitmask)
        if self.utf8 is not None:
            self.utf8.restrict(self.bitmask[0])
        view = row.view(1, -1)
        xgr.apply_token_bitmask_inplace(view, self.bitmask, vocab_size=self.vocab_size)

    def can_start(self) -> bool:
        """Whether any token (a stop token included, for a constraint the empty text satisfies) may come first."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return bool(self.bitmask.any())

    def accept(self, token: int) -> bool:
        """Advance with the sampled token; False if the grammar rejects it (a bug upstream of the mask)."""
        if self.utf8 is not None:
            self.utf8.accept(token)
        return bool(self.matcher.accept_token(token))

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_terminated())
