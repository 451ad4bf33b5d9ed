"""Workload spec: what the planner needs to know about a batch of requests."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    """Mean/max prompt length and generation length.

    padded=True models FlexGen-style batches where every prompt is padded to the max
    prompt length; otherwise micro-batches hold about mean_prompt tokens per sequence
    (balanced ragged batching, paper Algorithm 2).
    """

    prompt_len: float
    gen_len: int
    max_prompt_len: int | None = None
    padded: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.gen_len < 1:
            raise ValueError("prompt_len must be > 0 and gen_len >= 1")
        if self.max_prompt_len is not None and self.max_prompt_len < self.prompt_len:
            raise ValueError("max_prompt_len must be >= prompt_len")

    @property
    def effective_prompt(self) -> float:
        """Prompt tokens per sequence that are computed and cached."""
        if self.padded and self.max_prompt_len:
            return float(self.max_prompt_len)
        return float(self.prompt_len)

    @property
    def peak_prompt(self) -> float:
        """Longest prompt a micro-batch may carry (prefill activation sizing)."""
        return float(self.max_prompt_len or self.prompt_len) if self.padded else float(self.prompt_len)

    @property
    def mean_context(self) -> float:
        """Average attention context over the decode steps."""
        return self.effective_prompt + self.gen_len / 2.0

    @property
    def max_context(self) -> float:
        """Context at the last step: what the KV cache must hold per sequence."""
        return self.effective_prompt + self.gen_len

    def to_dict(self) -> dict:
        return asdict(self)
