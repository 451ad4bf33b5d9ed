"""Result objects in the shape of vLLM's offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelight.sampling.logprobs import Logprob  # noqa: F401 - vLLM's name, importable from here


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    cumulative_logprob: float | None = None  # with logprobs: the sum of the chosen tokens' logprobs
    logprobs: list[dict] | None = None  # with logprobs=k: per token {token_id: Logprob}
    # the stop string or stop token (generation_config.json's extra end ids too) that ended it; None: EOS, length
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list | None = field(default=None)  # with prompt_logprobs=k: None, then a dict per token

    @property
    def finished(self) -> bool:
        return True
