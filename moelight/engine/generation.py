"""The generation loop: admit, prefill, decode, sample, finish, one step after another.

Requests are token lists with their SamplingParams. The scheduler (engine/scheduler.py) decides
which sequences run and where their KV lives; an executor (runtime/executor.py: plain CPU, the
CGOPipe runtime, or latency mode's expert cache) runs the passes; the sampler draws each
sequence's next token. Finished sequences are reported through `on_finish` at once, so the
caller can write them to disk before anything else can fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelight.engine.batching import split_batches
from moelight.engine.scheduler import Scheduler
from moelight.engine.sequence import Sequence, SequenceResult
from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.executor import Executor
from moelight.runtime.latent_kv_cache import kv_cache_class
from moelight.runtime.plain_executor import PlainExecutor
from moelight.sampling.params import SamplingParams
from moelight.sampling.sampler import Sampler

__all__ = ["Engine", "GenerationStats", "SequenceResult"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens produced by decode steps (all but each sequence's first)
    wall_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # each decode step: a token for every active sequence
    # prompt_tokens / generated_tokens count finished sequences only, as they finish: what was reported
    batches: list[dict] = field(default_factory=list)


class Engine:
    """Runs requests through an executor (plain CPU, the CGOPipe runtime, or an expert cache).

    refill=True (default): a rolling batch of at most N sequences; when at least N/8
    slots are free, waiting requests are prefilled into them, so a long answer does not
    hold N-1 idle slots. refill=False: the paper's static batches of N, each run until
    its last sequence ends. Sampling does not depend on the choice (per-request seeds);
    in float32 the tokens are the same, in 16-bit a different batch mix changes matmul
    rounding and can flip a near-tied greedy token, as in any batched engine.
    """

    def __init__(self, model: MoECausalLM, eos_token_ids: tuple[int, ...], max_prefill_tokens: int = 4096,
                 executor: Executor | None = None, refill: bool = True) -> None:
        self.model = model
        self.executor = executor or PlainExecutor(model)
        self.eos = set(eos_token_ids)
        self.max_prefill_tokens = max_prefill_tokens
        self.refill = refill

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
        batches = [range(len(prompts))] if self.refill else split_batches(len(prompts), batch_size)
        try:
            for batch in batches:
                run = _Run(self, [prompts[i] for i in batch], list(batch), params, sampler, stats, on_finish)
                for r in run.generate(batch_size, micro_batch_size):
                    results[r.index] = r
        finally:  # an interrupted generation still says how long it ran and what it finished
            stats.wall_seconds += time.perf_counter() - t0
        return results  # type: ignore[return-value]


class _Run:
    """One generation over a list of sequences sharing one KV-cache pool: the loop of steps."""

    def __init__(self, engine: Engine, prompts, indices, params, sampler, stats, on_finish) -> None:
        self.engine, self.prompts, self.sampler = engine, prompts, sampler
        self.executor = engine.executor
        self.stats, self.on_finish = stats, on_finish
        self.seqs = [Sequence(i, len(p), params[i]) for i, p in zip(indices, prompts, strict=True)]
        self.finished: list[SequenceResult] = []

    def generate(self, batch_size: int, micro_batch_size: int) -> list[SequenceResult]:
        sched = self.sched = Scheduler(self.seqs, batch_size, micro_batch_size)
        model = self.engine.model
        self.cache = kv_cache_class(model.config).pool(model.config, sched.capacity,
                                                         model.embed_tokens.weight.dtype)
        wave = None
        while True:
            new = sched.admit()
            if new:
                wave = {"sequences": len(new), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0,
                        "micro_batches": len(sched.decode_batches())}
                self.stats.batches.append(wave)
                t0 = time.perf_counter()
                self._prefill(new)
                wave["prefill_s"] = time.perf_counter() - t0
                self.stats.prefill_seconds += wave["prefill_s"]
            batches = sched.decode_batches()
            if not batches:
                break
            t0 = time.perf_counter()
            self._decode_step(batches)
            dt = time.perf_counter() - t0
            self.stats.step_seconds.append(dt)
            wave["decode_s"] += dt
            wave["decode_steps"] += 1
            self.stats.decode_seconds += dt
        return self.finished

    def _prefill(self, new: list[int]) -> None:
        for chunk in self.sched.prefill_chunks(new, self.engine.max_prefill_tokens):
            lens = torch.tensor([len(self.prompts[j]) for j in chunk], dtype=torch.int64)
            tokens = torch.tensor([t for j in chunk for t in self.prompts[j]], dtype=torch.int64)
            self._accept(chunk, self.executor.prefill(self.cache, tokens, lens, self.sched.offsets[chunk]))

    def _decode_step(self, batches: list[list[int]]) -> None:
        inputs = []
        for mb in batches:
            tokens = torch.tensor([self.seqs[j].out[-1] for j in mb], dtype=torch.int64)
            positions = torch.tensor([self.seqs[j].position for j in mb], dtype=torch.int64)
            inputs.append((tokens, self.sched.offsets[mb], positions))
        for mb, logits in zip(batches, self.executor.decode(self.cache, inputs), strict=True):
            self._accept(mb, logits)
            self.stats.decode_tokens += len(mb)

    def _accept(self, local: list[int], logits: torch.Tensor) -> None:
        """Sample one token per sequence; finished ones leave the scheduler and free their slots,
        and are reported at once (so the caller can write them to disk)."""
        tokens = self.sampler(logits, [self.seqs[j].index for j in local]).tolist()
        for j, tok in zip(local, tokens, strict=True):
            s = self.seqs[j]
            if s.append(tok, self.engine.eos):
                self.executor.release_sequence(self.sched.finish(j))
                self.stats.prompt_tokens += s.prompt_len
                self.stats.generated_tokens += len(s.out)
                res = s.result()
                self.finished.append(res)
                if self.on_finish is not None:
                    self.on_finish(res)
