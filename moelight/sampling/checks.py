"""What a request's sampling parameters ask of a model, checked before anything loads: token ids inside
its vocabulary, a tokenizer for stop strings, bad words and grammars, and grammars that compile.
The checker also owns the tokenizer's compiled grammars, which the engine then uses."""

from __future__ import annotations

from moelight.sampling.params import SamplingParams


class SamplingChecker:
    def __init__(self, tokenizer, vocab_size: int, stop_ids) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, tuple(stop_ids)
        self._grammars = None

    @property
    def grammars(self):
        """The tokenizer's compiled grammars (sampling/structured.py), made at the first request for one."""
        if self._grammars is None:
            from moelight.sampling.structured import GrammarCache

            self._grammars = GrammarCache(self.tokenizer, self.vocab_size, self.stop_ids)
        return self._grammars

    def check(self, p: SamplingParams) -> None:
        """ValueError (or StructuredOutputError) naming what this model cannot do for `p`."""
        ids = [*p.stop_token_ids, *(p.allowed_token_ids or []), *(p.logit_bias or {})]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside the model's vocabulary (0..{self.vocab_size - 1})")
        if self.tokenizer is None and (p.stop or p.bad_words or p.structured_outputs is not None):
            raise ValueError("stop strings, bad_words and structured outputs need the tokenizer (not "
                             "skip_tokenizer_init)")
        if p.structured_outputs is not None:
            self.grammars.check(p.structured_outputs)
