"""The generation loop: batches, balanced micro-batches, prefill, decode, stopping.

Requests are token lists with their SamplingParams. Up to N sequences share one ragged
KV-cache pool (each owns a contiguous region, see slot_pool.py); they are prefilled in
micro-batches of at most `max_prefill_tokens` tokens, then decoded one token per
sequence per step, micro-batch by micro-batch. Finished sequences leave their
micro-batch at once, free their region for a waiting request, and are reported through
`on_finish`, so the caller can write them to disk before anything else can fail.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moelight.engine.batching import balance_microbatches, split_batches
from moelight.engine.slot_pool import SlotPool
from moelight.models.causal_lm import MoECausalLM
from moelight.runtime import forward
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.sampling.params import SamplingParams
from moelight.sampling.sampler import Sampler


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
    step_seconds: list[float] = field(default_factory=list)  # each decode step: a token for every active sequence
    batches: list[dict] = field(default_factory=list)


@dataclass
class _Seq:
    index: int
    prompt_len: int
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    finish: str | None = None


class Engine:
    """Runs requests through an executor (plain CPU, or the CGOPipe runtime).

    refill=True (default): a rolling batch of at most N sequences; when at least N/8
    slots are free, waiting requests are prefilled into them, so a long answer does not
    hold N-1 idle slots. refill=False: the paper's static batches of N, each run until
    its last sequence ends. Sampling does not depend on the choice (per-request seeds);
    in float32 the tokens are the same, in 16-bit a different batch mix changes matmul
    rounding and can flip a near-tied greedy token, as in any batched engine.
    """

    def __init__(self, model: MoECausalLM, eos_token_ids: tuple[int, ...], max_prefill_tokens: int = 4096,
                 executor=None, refill: bool = True) -> None:
        self.model = model
        self.executor = executor or forward.PlainExecutor(model)
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
        for batch in batches:
            run = _Run(self, [prompts[i] for i in batch], list(batch), params, sampler, stats, on_finish)
            for r in run.generate(batch_size, micro_batch_size):
                results[r.index] = r
        stats.wall_seconds += time.perf_counter() - t0
        return results  # type: ignore[return-value]

    def _prefill_chunks(self, micro_batches: list[list[int]], prompts: list[list[int]]) -> list[list[int]]:
        """Each micro-batch, cut further so a prefill pass holds at most max_prefill_tokens
        (a pass never mixes micro-batches: the executors size their buffers by micro-batch)."""
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


class _Run:
    """One generation over a list of sequences sharing one KV-cache pool.

    Sized for the N largest sequences (prompt + max new tokens), the pool holds any N of
    them at once; static batching is the case where everything is admitted at the start.
    """

    def __init__(self, engine: Engine, prompts, indices, params, sampler, stats, on_finish) -> None:
        self.engine, self.prompts, self.sampler = engine, prompts, sampler
        self.stats, self.on_finish = stats, on_finish
        self.seqs = [_Seq(i, len(p), params[i]) for i, p in zip(indices, prompts, strict=True)]
        self.sizes = [len(p) + s.params.max_tokens for p, s in zip(prompts, self.seqs, strict=True)]
        self.offsets = torch.zeros(len(prompts), dtype=torch.int64)
        self.finished: list[SequenceResult] = []

    def generate(self, batch_size: int, micro_batch_size: int) -> list[SequenceResult]:
        n = max(1, min(batch_size, len(self.seqs)))
        capacity = sum(sorted(self.sizes, reverse=True)[:n])
        model = self.engine.model
        self.cache = RaggedKVCache.pool(model.config, capacity, model.embed_tokens.weight.dtype)
        self.pool = SlotPool(capacity)
        n_mb = math.ceil(n / max(1, micro_batch_size))
        mbs: list[list[int]] = [[] for _ in range(n_mb)]
        pending = deque(range(len(self.seqs)))
        refill_at = max(1, n // 8)
        wave = None
        while True:
            active = sum(len(mb) for mb in mbs)
            if pending and (active == 0 or n - active >= refill_at):
                new = self._admit(pending, n - active)
                if new:
                    wave = {"sequences": len(new), "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
                    self.stats.batches.append(wave)
                    self._place(new, mbs, micro_batch_size, n_mb)
                    wave["micro_batches"] = sum(1 for mb in mbs if mb)
                    t0 = time.perf_counter()
                    self._prefill(new, mbs)
                    wave["prefill_s"] = time.perf_counter() - t0
                    self.stats.prefill_seconds += wave["prefill_s"]
            if not any(mbs):
                if pending:
                    raise RuntimeError("KV pool cannot hold the next request (engine bug: pool too small)")
                break
            t0 = time.perf_counter()
            self._decode_step(mbs)
            dt = time.perf_counter() - t0
            self.stats.step_seconds.append(dt)
            wave["decode_s"] += dt
            wave["decode_steps"] += 1
            self.stats.decode_seconds += dt
        self.stats.prompt_tokens += sum(map(len, self.prompts))
        self.stats.generated_tokens += sum(len(s.out) for s in self.seqs)
        return self.finished

    def _admit(self, pending: deque, room: int) -> list[int]:
        """Waiting sequences, in order, while slots and a contiguous region are free."""
        new = []
        while pending and len(new) < room:
            start = self.pool.take(self.sizes[pending[0]])
            if start is None:  # wait for a region to free up; keep the request order
                break
            j = pending.popleft()
            self.offsets[j] = start
            new.append(j)
        return new

    def _place(self, new: list[int], mbs: list[list[int]], mu: int, n_mb: int) -> None:
        """Into an empty run: balanced micro-batches (Alg. 2); else the least-filled ones."""
        if not any(mbs):
            groups = balance_microbatches([len(self.prompts[j]) for j in new], math.ceil(len(new) / max(1, mu)))
            for k, g in enumerate(groups):
                mbs[k] = [new[i] for i in g]
            return
        for j in new:
            min(mbs, key=len).append(j)

    def _prefill(self, new: list[int], mbs: list[list[int]]) -> None:
        fresh = set(new)
        groups = [[j for j in mb if j in fresh] for mb in mbs]
        for chunk in self.engine._prefill_chunks([g for g in groups if g], self.prompts):
            lens = torch.tensor([len(self.prompts[j]) for j in chunk], dtype=torch.int64)
            tokens = torch.tensor([t for j in chunk for t in self.prompts[j]], dtype=torch.int64)
            self._accept(chunk, self.engine.executor.prefill(self.cache, tokens, lens, self.offsets[chunk]), mbs)

    def _decode_step(self, mbs: list[list[int]]) -> None:
        live = [list(mb) for mb in mbs if mb]
        inputs = []
        for mb in live:
            tokens = torch.tensor([self.seqs[j].out[-1] for j in mb], dtype=torch.int64)
            positions = torch.tensor([self.seqs[j].prompt_len + len(self.seqs[j].out) - 1 for j in mb],
                                     dtype=torch.int64)
            inputs.append((tokens, self.offsets[mb], positions))
        for mb, logits in zip(live, self.engine.executor.decode(self.cache, inputs), strict=True):
            self._accept(mb, logits, mbs)
            self.stats.decode_tokens += len(mb)

    def _accept(self, local: list[int], logits: torch.Tensor, mbs: list[list[int]]) -> None:
        """Sample one token per sequence; finished ones leave their micro-batch and free
        their slots, and are reported at once (so the caller can write them to disk)."""
        tokens = self.sampler(logits, [self.seqs[j].index for j in local]).tolist()
        for j, tok in zip(local, tokens, strict=True):
            s = self.seqs[j]
            s.out.append(tok)
            if not s.params.ignore_eos and (tok in self.engine.eos or tok in s.params.stop_token_ids):
                s.finish = "stop"
            elif len(s.out) >= s.params.max_tokens:
                s.finish = "length"
            if s.finish:
                for mb in mbs:
                    if j in mb:
                        mb.remove(j)
                self.pool.give(int(self.offsets[j]), self.sizes[j])
                release = getattr(self.engine.executor, "release_sequence", None)  # per-sequence executor state
                if release is not None:
                    release(int(self.offsets[j]))
                res = SequenceResult(s.index, s.out, s.finish)
                self.finished.append(res)
                if self.on_finish is not None:
                    self.on_finish(res)
