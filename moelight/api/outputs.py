"""Result objects in the shape of vLLM's offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

from moelight.sampling.logprobs import Logprob  # noqa: F401 - vLLM's name, importable from here


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" or "length" (vLLM's None: not finished, never so in an offline call)
    cumulative_logprob: float | None = None  # with logprobs: the sum of the chosen tokens' logprobs
    logprobs: list[dict] | None = None  # with logprobs=k: per token {token_id: Logprob}
    # the stop string or stop token (generation_config.json's extra end ids too) that ended it; None: EOS, length
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """vLLM's: an output with a finish reason has ended (an offline call returns only those)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list | None = field(default=None)  # with prompt_logprobs=k: None, then a dict per token
    # vLLM's: prompt tokens whose KV came from the prefix cache, computed for another request of the same call
    # (its first sample's; 0 without enable_prefix_caching, and across calls: each call starts a cache of its own)
    num_cached_tokens: int = 0
    metrics: None = None  # vLLM's offline LLM keeps no per-request stats (disable_log_stats): None; see last_report

    @property
    def finished(self) -> bool:
        return True
