"""The generation loop: batches, balanced micro-batches, prefill, decode, stopping.

Requests are token lists with their SamplingParams. A batch of N sequences shares one
ragged KV cache; it is prefilled in micro-batches of at most `max_prefill_tokens`
tokens, then decoded one token per sequence per step, micro-batch by micro-batch.
Finished sequences leave their micro-batch at once and are reported through
`on_finish`, so the caller can write them to disk before anything else can fail.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelight import forward
from moelight.batching import balance_microbatches, split_batches
from moelight.kv_cache import RaggedKVCache
from moelight.model import MixtralModel
from moelight.sampling import Sampler, SamplingParams


@dataclass
class SequenceResult:
    index: int
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (all but each sequence's first)
    wall_seconds: float = 0.0
    batches: list[dict] = field(default_factory=list)


@dataclass
class _Seq:
    index: int
    prompt_len: int
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    finish: str | None = None


class Engine:
    def __init__(self, model: MixtralModel, eos_token_ids: tuple[int, ...], max_prefill_tokens: int = 4096,
                 executor=None) -> None:
        self.model = model
        self.executor = executor or forward.PlainExecutor(model)
        self.eos = set(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        seeds: list[int],
        batch_size: int,
        micro_batch_size: int,
        on_finish: Callable[[SequenceResult], None] | None = None,
        stats: GenerationStats | None = None,
    ) -> list[SequenceResult]:
        stats = stats if stats is not None else GenerationStats()
        results: list[SequenceResult | None] = [None] * len(prompts)
        sampler = Sampler(params, seeds)
        t0 = time.perf_counter()
        for batch in split_batches(len(prompts), batch_size):
            for r in self._run_batch([prompts[i] for i in batch], list(batch), params, sampler,
                                     micro_batch_size, stats, on_finish):
                results[r.index] = r
        stats.wall_seconds += time.perf_counter() - t0
        return results  # type: ignore[return-value]

    def _run_batch(self, prompts, indices, params, sampler, micro_batch_size, stats, on_finish):
        seqs = [_Seq(i, len(p), params[i]) for i, p in zip(indices, prompts, strict=False)]
        cache = RaggedKVCache.allocate(
            self.model.config, [len(p) + s.params.max_tokens for p, s in zip(prompts, seqs, strict=False)],
            self.model.embed_tokens.weight.dtype,
        )
        n_mb = math.ceil(len(seqs) / max(1, micro_batch_size))
        micro_batches = balance_microbatches([len(p) for p in prompts], n_mb)
        finished: list[SequenceResult] = []

        def accept(local: list[int], logits: torch.Tensor) -> None:
            tokens = sampler(logits, [seqs[j].index for j in local]).tolist()
            for j, tok in zip(local, tokens, strict=False):
                s = seqs[j]
                s.out.append(tok)
                if not s.params.ignore_eos and (tok in self.eos or tok in s.params.stop_token_ids):
                    s.finish = "stop"
                elif len(s.out) >= s.params.max_tokens:
                    s.finish = "length"
                if s.finish:
                    res = SequenceResult(s.index, s.out, s.finish)
                    finished.append(res)
                    if on_finish is not None:
                        on_finish(res)

        t0 = time.perf_counter()
        for chunk in self._prefill_chunks(micro_batches, prompts):
            lens = torch.tensor([len(prompts[j]) for j in chunk], dtype=torch.int64)
            tokens = torch.tensor([t for j in chunk for t in prompts[j]], dtype=torch.int64)
            accept(chunk, self.executor.prefill(cache, tokens, lens, cache.offsets[chunk]))
        t1 = time.perf_counter()
        steps = 0
        while True:
            active_mbs = [[j for j in mb if seqs[j].finish is None] for mb in micro_batches]
            active_mbs = [mb for mb in active_mbs if mb]
            if not active_mbs:
                break
            inputs = []
            for mb in active_mbs:
                tokens = torch.tensor([seqs[j].out[-1] for j in mb], dtype=torch.int64)
                positions = torch.tensor([seqs[j].prompt_len + len(seqs[j].out) - 1 for j in mb], dtype=torch.int64)
                inputs.append((tokens, cache.offsets[mb], positions))
            for mb, logits in zip(active_mbs, self.executor.decode(cache, inputs), strict=False):
                accept(mb, logits)
                stats.decode_tokens += len(mb)
            steps += 1
        t2 = time.perf_counter()
        stats.prompt_tokens += sum(len(p) for p in prompts)
        stats.generated_tokens += sum(len(s.out) for s in seqs)
        stats.prefill_seconds += t1 - t0
        stats.decode_seconds += t2 - t1
        stats.batches.append({"sequences": len(seqs), "micro_batches": len(micro_batches),
                              "prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps})
        return finished

    def _prefill_chunks(self, micro_batches: list[list[int]], prompts: list[list[int]]) -> list[list[int]]:
        """Each micro-batch, cut further so a prefill pass holds at most max_prefill_tokens."""
        chunks = []
        for mb in micro_batches:
            cur, tokens = [], 0
            for j in mb:
                n = len(prompts[j])
                if cur and tokens + n > self.max_prefill_tokens:
                    chunks.append(cur)
                    cur, tokens = [], 0
                cur.append(j)
                tokens += n
            if cur:
                chunks.append(cur)
        return chunks
