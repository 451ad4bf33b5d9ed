"""The executor interface: what the generation loop asks of whatever runs the model's passes.

Three executors implement it: `PlainExecutor` (every pass on the CPU, runtime/plain_executor.py),
the CGOPipe runtime (`pipeline.pipeline_executor.PipelineExecutor`, a schedule's task graph on a device)
and latency mode's `expert_cache.cache_executor.ExpertCacheExecutor` (a device expert cache). The
engine (engine/generation.py) sees only this: prefill packed prompts, decode micro-batches,
release a finished sequence, report stats, close. Adding an executor is implementing these five.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moelight.runtime.kv_cache import RaggedKVCache

# one decode micro-batch: next tokens [B], each sequence's KV-cache offset [B], positions [B]
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Executor(ABC):
    """Runs the model's passes over a KV cache the engine owns; returns float32 logits.

    Where the KV of a batch lives is given as ragged offsets [B], or, by executors that set
    `supports_paged`, as a `runtime.paged_layout.PagedLayout` (block tables; prefix sharing)."""

    supports_paged = False

    @abstractmethod
    def prefill(self, cache: RaggedKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
                offsets: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Packed prompts tokens [T] (seq_lens [B], cache offsets [B]) -> last-token logits [B, vocab];
        with `rows`, the logits of those packed positions instead (prompt logprobs)."""

    @abstractmethod
    def decode(self, cache: RaggedKVCache, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """One token per sequence of every micro-batch -> logits [B_i, vocab] per micro-batch."""

    def copy_pages(self, cache: RaggedKVCache, copies: list[tuple[int, int]], page_size: int) -> None:
        """Copy-on-write of paged KV (source, destination pages) wherever this executor keeps the cache."""
        cache.copy_pages(copies, page_size)

    def release_sequence(self, offset: int) -> None:  # noqa: B027 - most executors keep nothing per sequence
        """The sequence at KV offset `offset` finished; forget what was kept for it."""

    def stats(self) -> dict:
        """Figures for the job's report (the expert cache's hits and fetches); {} where there are none."""
        return {}

    def close(self) -> None:  # noqa: B027 - nothing to free on the CPU
        """Free the device and stop worker threads; the executor is unusable after."""
