"""One sequence being generated: its prompt length, sampling parameters, tokens, and why it ended.

It ends (vLLM's rules) at a stop token (EOS or `stop_token_ids`, not before `min_tokens`; `ignore_eos`
ignores EOS only), at a `stop` string found in its detokenized text after `min_tokens` (the text is cut
before it unless `include_stop_str_in_output`), when its grammar is complete, or at `max_tokens`. `stop_reason` says
which stop string or stop token ended it (None for the tokenizer's EOS and length; generation_config.json's
other end ids name themselves, as vLLM lists them among the stop_token_ids). The text leaves out the stop token
that ended it, as vLLM's does, unless `include_stop_str_in_output` (`text_token_ids`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moelight.engine.output_text import OutputText
from moelight.sampling.logits_processors import RowState
from moelight.sampling.params import SamplingParams


@dataclass
class SequenceResult:
    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or string, a complete grammar) or "length"
    stop_reason: int | str | None = None
    text: str | None = None  # the detokenized text, when the engine has a tokenizer
    logprobs: list[dict] | None = None  # per generated token: {token_id: Logprob}
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    ended_by_token: bool = False  # its last token is the EOS or stop token that ended it
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (computed by another sequence)

    def text_token_ids(self, params: SamplingParams) -> list[int]:
        return text_token_ids(self.token_ids, self.ended_by_token, params)


def text_token_ids(ids: list[int], ended_by_token: bool, params: SamplingParams) -> list[int]:
    """The tokens a text shows: all but an ending stop token, unless include_stop_str_in_output."""
    return ids[:-1] if ended_by_token and not params.include_stop_str_in_output else ids


@dataclass
class Sequence:
    index: int  # the request's position in the engine's input
    prompt_len: int
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    finish: str | None = None
    state: RowState | None = None  # what logits processors and the grammar need (None: nothing to do)
    stop_reason: int | str | None = None
    text: str | None = None
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: list | None = None
    ended_by_token: bool = False
    context: list[int] = field(default_factory=list)  # the prompt's last tokens: the text reads after them
    grown: OutputText | None = field(default=None, repr=False)  # the stop-string search's text, token by token
    num_cached_tokens: int = 0  # set at prefill: prompt tokens it did not compute

    @property
    def position(self) -> int:
        """Position of the last generated token (the next decode step's input)."""
        return self.prompt_len + len(self.out) - 1

    @property
    def kv_slots(self) -> int:
        """KV-cache slots the sequence may fill: its prompt and every token it may generate."""
        return self.prompt_len + self.params.max_tokens

    def append(self, token: int, eos: set[int], decode: Callable[[list[int], bool, list[int]], str] | None = None,
               listed_eos: frozenset[int] = frozenset()) -> bool:
        """Add a sampled token; True when the sequence has ended. `listed_eos`: end ids that vLLM lists among
        the stop_token_ids (generation_config.json's beside the tokenizer's EOS): they name themselves."""
        p = self.params
        self.out.append(token)
        constraint = self.state.constraint if self.state is not None else None
        if constraint is not None:
            constraint.accept(token)
        grammar_done = constraint is not None and constraint.done  # a finished grammar outranks min_tokens
        is_eos = token in eos and not p.ignore_eos  # ignore_eos ignores EOS only: stop_token_ids still stop
        stops = is_eos or token in p.stop_token_ids
        if (stops and len(self.out) >= p.min_tokens) or (grammar_done and (stops or token in eos)):
            self.finish = "stop"
            # vLLM: the tokenizer's EOS is no stop_reason, even if also listed; a listed end id is one
            self.stop_reason = None if is_eos and token not in listed_eos else token
            self.ended_by_token = True
            if p.stop and decode is not None:
                self.text = decode(text_token_ids(self.out, True, p), p.skip_special_tokens, self.context)
        elif p.stop and decode is not None and self._stop_string(decode, may_stop=len(self.out) > p.min_tokens):
            self.finish = "stop"
        elif grammar_done:
            self.finish = "stop"
        elif len(self.out) >= p.max_tokens:
            self.finish = "length"
        if self.finish is not None and decode is not None and p.detokenize:
            self._final_text(decode)
        return self.finish is not None

    def _final_text(self, decode) -> None:
        """The finished text (the stop-string search already holds it), less a character whose bytes had
        not all come (U+FFFD at its end), as vLLM's detokenizer holds those back."""
        p = self.params
        if not p.stop:
            self.text = decode(text_token_ids(self.out, self.ended_by_token, p), p.skip_special_tokens, self.context)
        if not isinstance(self.stop_reason, str):  # a text cut before a stop string ends where the stop began
            self.text = self.text.rstrip("\ufffd")

    def _stop_string(self, decode, may_stop: bool = True) -> bool:
        """Search the text grown by this token for a stop string (one may span the new and old text).
        Until `min_tokens` are out (`may_stop` False; vLLM checks stop strings once the output is longer
        than min_tokens) the text only grows: a stop string found there never ends the sequence. The text
        of a character whose bytes are still coming is U+FFFD until it completes, so the search starts
        before those placeholders (a stop string may begin with that character)."""
        before = len((self.text or "").rstrip("\ufffd"))
        if self.grown is None:
            self.grown = OutputText(decode, self.params.skip_special_tokens, self.context)
        text = self.grown.text(self.out)
        if not may_stop:
            self.text = text
            return False
        found = None
        for s in self.params.stop:
            at = text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is None:
            self.text = text
            return False
        at, s = found
        self.text = text[: at + len(s)] if self.params.include_stop_str_in_output else text[:at]
        self.stop_reason = s
        return True

    def result(self) -> SequenceResult:
        return SequenceResult(self.index, self.out, self.finish or "length", self.stop_reason,
                              self.text, self.logprobs, self.cumulative_logprob,
                              self.prompt_logprobs, self.ended_by_token, self.num_cached_tokens)
