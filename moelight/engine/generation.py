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
from moelight.errors import NumericalError
from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.executor import Executor
from moelight.runtime.latent_kv_cache import kv_cache_class
from moelight.runtime.plain_executor import PlainExecutor
from moelight.sampling.logits_processors import RowState, bad_word_ids
from moelight.sampling.logprobs import position_logprobs, prompt_logprobs
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
    prefill_computed_tokens: int = 0  # prompt positions prefill passes ran (shared prefixes are not rerun)
    prefix_reused_tokens: int = 0  # prompt positions whose KV came from shared pages
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
                 executor: Executor | None = None, refill: bool = True, tokenizer=None, grammars=None,
                 prefix_sharing: bool = True,
                 share_tokens: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 listed_eos: tuple[int, ...] = ()) -> None:
        """`tokenizer`: for stop strings, bad words and decoded logprob tokens; `grammars`: a
        sampling.structured.GrammarCache for structured outputs (both needed only when asked for);
        `prefix_sharing`: page the KV cache and compute common prefixes once, where the executor
        reads block tables (engine/block_manager.py); `share_tokens`: tensor-parallel ranks take
        rank 0's sampled tokens through it (each rank's logits may differ in the last bits; the
        batches must not); `listed_eos`: end ids that report themselves as stop_reason, as vLLM's
        stop_token_ids do (ResolvedModel.listed_eos)."""
        self.model = model
        self.share_tokens = share_tokens
        self.executor = executor or PlainExecutor(model)
        self.paged = (prefix_sharing and self.executor.supports_paged
                      and kv_cache_class(model.config).supports_paged)
        self.eos = set(eos_token_ids)
        self.listed_eos = frozenset(listed_eos)
        self.max_prefill_tokens = max_prefill_tokens
        self.refill = refill
        self.tokenizer, self.grammars = tokenizer, grammars

    def decode(self, ids: list[int], skip_special_tokens: bool = True, context: list[int] | None = None) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens, context or ())

    def row_state(self, prompt: list[int], params: SamplingParams, out: list[int]) -> RowState | None:
        """What the logits processors need for one sequence (None when it asks for none of them)."""
        if not params.has_processors:
            return None
        if (params.bad_words or params.stop) and self.tokenizer is None:
            raise ValueError("bad_words and stop strings need the model's tokenizer")
        constraint = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need a grammar cache (the engine's tokenizer)")
            constraint = self.grammars.constraint(params.structured_outputs)
        encode = (lambda text: self.tokenizer.encode(text, add_bos=False)) if self.tokenizer else None
        return RowState(params, prompt, out, frozenset(self.eos) | frozenset(params.stop_token_ids),
                        bad_word_ids(params.bad_words, encode), constraint)

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
        self.seqs = [Sequence(i, len(p), params[i], context=list(p[-24:]))  # an output's text reads after it
                     for i, p in zip(indices, prompts, strict=True)]
        for s, prompt in zip(self.seqs, prompts, strict=True):
            s.state = engine.row_state(prompt, s.params, s.out)
        self.finished: list[SequenceResult] = []
        self.decode = engine.decode if engine.tokenizer is not None else None

    def generate(self, batch_size: int, micro_batch_size: int) -> list[SequenceResult]:
        paged = self.prompts if self.engine.paged else None
        sched = self.sched = Scheduler(self.seqs, batch_size, micro_batch_size, prompts=paged)
        self.kv = sched.kv
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
                if sched.waiting:  # every running sequence ended at its first token: admit the next ones
                    continue
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
        """Prefill the admitted sequences, wave after wave (a wave reads prefixes the waves before it
        wrote); each computes only its uncached positions, and a twin takes its owner's logits."""
        for j in new:
            self.seqs[j].num_cached_tokens = self.kv.cached(j)
        reused = sum(self.seqs[j].num_cached_tokens for j in new)
        for wave in self.kv.prefill_waves(new):
            for chunk in self.sched.prefill_chunks(wave, self.engine.max_prefill_tokens):
                self._prefill_chunk(chunk)
            self.kv.computed(wave)
        self.stats.prefix_reused_tokens += reused

    def _prefill_chunk(self, chunk: list[int]) -> None:
        starts = [self.kv.cached(j) for j in chunk]
        lens = torch.tensor([len(self.prompts[j]) - c for j, c in zip(chunk, starts, strict=True)], dtype=torch.int64)
        tokens = torch.tensor([t for j, c in zip(chunk, starts, strict=True) for t in self.prompts[j][c:]],
                              dtype=torch.int64)
        place = self.kv.layout(chunk, with_starts=True)
        self.stats.prefill_computed_tokens += int(lens.sum())
        if not any(self.seqs[j].params.prompt_logprobs is not None for j in chunk):
            self._accept_with_twins(chunk, self.executor.prefill(self.cache, tokens, lens, place))
            return
        # every position of the prompts that ask for prompt_logprobs (they reuse no prefix), the last of the others
        rows, spans, at = [], [], 0
        for j, n in zip(chunk, lens.tolist(), strict=True):
            wants = self.seqs[j].params.prompt_logprobs is not None
            spans.append((len(rows), len(rows) + (n if wants else 1)))
            rows += list(range(at, at + n)) if wants else [at + n - 1]
            at += n
        logits = self.executor.prefill(self.cache, tokens, lens, place, rows=torch.tensor(rows))
        for j, (a, b) in zip(chunk, spans, strict=True):
            s = self.seqs[j]
            if s.params.prompt_logprobs is not None:
                s.prompt_logprobs = prompt_logprobs(logits[a:b], self.prompts[j],
                                                    s.params.prompt_logprobs, self._token_decoder(s.params))
        self._accept_with_twins(chunk, logits[torch.tensor([b - 1 for _, b in spans])])

    def _accept_with_twins(self, chunk: list[int], logits: torch.Tensor) -> None:
        """Sample the chunk's first tokens; each sequence's twins (same prompt, computed once) sample
        theirs from its logits row with their own generators."""
        twins = [(r, t) for r, j in enumerate(chunk) for t in self.kv.twins(j)]
        if twins:
            chunk = chunk + [t for _, t in twins]
            logits = torch.cat([logits, logits[torch.tensor([r for r, _ in twins])]])
        self._accept(chunk, logits)

    def _logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """The sampled tokens' logprobs (and the top-k) from the raw logits, for the rows that ask."""
        for row, s in enumerate(seqs):
            k = s.params.logprobs
            if k is None:
                continue
            entry, chosen = position_logprobs(logits[row:row + 1], tokens[row:row + 1], k,
                                              self._token_decoder(s.params))
            s.logprobs = (s.logprobs or []) + entry
            s.cumulative_logprob = (s.cumulative_logprob or 0.0) + chosen[0]

    def _decode_step(self, batches: list[list[int]]) -> None:
        copies = self.kv.copy_on_write({j: self.seqs[j].position for mb in batches for j in mb})
        if copies:
            self.executor.copy_pages(self.cache, copies, self.kv.page_size)
        inputs = []
        for mb in batches:
            tokens = torch.tensor([self.seqs[j].out[-1] for j in mb], dtype=torch.int64)
            positions = torch.tensor([self.seqs[j].position for j in mb], dtype=torch.int64)
            inputs.append((tokens, self.kv.layout(mb), positions))
        for mb, logits in zip(batches, self.executor.decode(self.cache, inputs), strict=True):
            self._accept(mb, logits)
            self.stats.decode_tokens += len(mb)

    def _token_text(self, token: int) -> str:
        return self.engine.tokenizer.piece(token) if self.decode is not None else None

    def _token_decoder(self, params: SamplingParams) -> Callable[[int], str] | None:
        """What fills a Logprob's decoded_token: nothing under detokenize=False, as vLLM leaves it None."""
        return self._token_text if params.detokenize else None

    def _accept(self, local: list[int], logits: torch.Tensor) -> None:
        """Sample one token per sequence; finished ones leave the scheduler and free their slots,
        and are reported at once (so the caller can write them to disk)."""
        if not bool(torch.isfinite(logits.sum())):  # one pass, no mask: a NaN or an inf makes the sum non-finite
            raise NumericalError(
                f"the model produced non-finite logits for {len(local)} sequence(s) ({logits.dtype} logits from a "
                f"{self.engine.model.embed_tokens.weight.dtype} model): an overflow, most often of float16 "
                "activations; run with --dtype bfloat16 (or float32) instead")
        seqs = [self.seqs[j] for j in local]
        states = [s.state or RowState(s.params, [], s.out) for s in seqs] if any(s.state for s in seqs) else None
        tokens = self.sampler(logits, [s.index for s in seqs], states)
        if self.engine.share_tokens is not None:
            tokens = self.engine.share_tokens(tokens)
        self._logprobs(seqs, logits, tokens)
        for j, tok in zip(local, tokens.tolist(), strict=True):
            s = self.seqs[j]
            if s.append(tok, self.engine.eos, self.decode, self.engine.listed_eos):
                self.executor.release_sequence(self.sched.finish(j))
                self.stats.prompt_tokens += s.prompt_len
                self.stats.generated_tokens += len(s.out)
                res = s.result()
                self.finished.append(res)
                if self.on_finish is not None:
                    self.on_finish(res)
