"""The plain executor: the whole model on the CPU, pass by pass (what a CPU-only host runs)."""

from __future__ import annotations

import torch

from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.executor import Executor, MicroBatch
from moelight.runtime.forward import decode_step, prefill
from moelight.runtime.kv_cache import RaggedKVCache


class PlainExecutor(Executor):
    """Runs every pass on the CPU, one micro-batch after another (the CGOPipe runtime walks the
    micro-batches layer by layer instead)."""

    supports_paged = True

    def __init__(self, model: MoECausalLM) -> None:
        self.model = model

    def prefill(self, cache: RaggedKVCache, tokens, seq_lens, offsets, rows=None) -> torch.Tensor:
        """Returns logits [B, vocab] (float32) of each prompt's last token (or of the packed positions `rows`)."""
        return self.model.logits(prefill(self.model, cache, tokens, seq_lens, offsets, rows))

    def decode(self, cache: RaggedKVCache, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """micro_batches: (tokens, offsets, positions) each -> logits [B_i, vocab] each."""
        return [self.model.logits(decode_step(self.model, cache, *mb)) for mb in micro_batches]
