"""One sequence being generated: its prompt length, sampling parameters, tokens and why it ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelight.sampling.params import SamplingParams


@dataclass
class SequenceResult:
    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass
class Sequence:
    index: int  # the request's position in the engine's input
    prompt_len: int
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    finish: str | None = None

    @property
    def position(self) -> int:
        """Position of the last generated token (the next decode step's input)."""
        return self.prompt_len + len(self.out) - 1

    @property
    def kv_slots(self) -> int:
        """KV-cache slots the sequence may fill: its prompt and every token it may generate."""
        return self.prompt_len + self.params.max_tokens

    def append(self, token: int, eos: set[int]) -> bool:
        """Add a sampled token; True when the sequence has ended (EOS, a stop token, or max_tokens)."""
        self.out.append(token)
        if not self.params.ignore_eos and (token in eos or token in self.params.stop_token_ids):
            self.finish = "stop"
        elif len(self.out) >= self.params.max_tokens:
            self.finish = "length"
        return self.finish is not None

    def result(self) -> SequenceResult:
        return SequenceResult(self.index, self.out, self.finish or "length")
