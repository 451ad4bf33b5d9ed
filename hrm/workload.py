"""Workload spec: what the planner needs to know about a batch of requests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class WorkloadSpec:
    """Mean/max prompt length and generation length.

    padded=True models FlexGen-style batches where every prompt is padded to the max
    prompt length; otherwise micro-batches hold about mean_prompt tokens per sequence
    (balanced ragged batching, paper Algorithm 2). prefill_chunk: the most prompt tokens one
    prefill pass holds (the runtime's --max-prefill-tokens; it runs each pass through all layers,
    streaming the paged weights every pass); None: one micro-batch per pass, the passes run
    layer-major and the weights stream once per batch (the paper's system and FlexGen).
    shared_prefix: prompt tokens per sequence (a mean) whose KV a shared prefix serves (prefix
    sharing: a system prompt, few-shot examples, the n samples of one prompt): prefill does not
    compute them again; decode attention still reads them. The memory they save is in kv_pool (pool_tokens).
    kv_pool: the token slots of the KV pool the engine reserves for a batch of 1, 2, ... sequences
    (moelight/runtime/paged_layout.pool_table: the rooms of the largest ones in whole pages, each
    shared prefix counted once per distinct prefix live at once); None: kv_pool_shared's pool, else every
    sequence max_context slots, unshared.
    kv_pool_shared: a job given as figures (plan / simulate --shared-prefix), whose prompts are taken to share
    one prefix: (slots a sequence reserves alone, slots each reserves beside the prefix, slots of the prefix,
    held once for the whole batch); moelight/runtime/paged_layout.one_prefix_pool says them as the engine's
    paged pool would.
    argmax_only: every request greedy, without logits processors or logprobs: the host sampler takes
    each row's argmax and makes no working copies of the logits (hrm/operators.sampled_logits_bytes).
    """

    prompt_len: float
    gen_len: int
    max_prompt_len: int | None = None
    padded: bool = False
    prefill_chunk: int | None = None
    shared_prefix: float = 0.0
    kv_pool: tuple[int, ...] | None = field(default=None, repr=False)
    argmax_only: bool = False
    kv_pool_shared: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.gen_len < 1:
            raise ValueError("prompt_len must be > 0 and gen_len >= 1")
        if self.max_prompt_len is not None and self.max_prompt_len < self.prompt_len:
            raise ValueError("max_prompt_len must be >= prompt_len")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1 token")
        if not 0.0 <= self.shared_prefix <= self.prompt_len:
            raise ValueError("shared_prefix must be in [0, prompt_len]")

    def prefill_passes(self, mu, n_mb):
        """Prefill passes of a batch of n_mb micro-batches of mu sequences: each micro-batch is
        prefilled on its own, cut into passes of at most prefill_chunk tokens (whole prompts)."""
        mu, n_mb = np.asarray(mu, float), np.asarray(n_mb, float)
        if self.prefill_chunk is None:
            return n_mb * np.ones_like(mu)
        per_pass = np.maximum(1.0, np.floor(self.prefill_chunk / max(1.0, self.computed_prompt)))
        return n_mb * np.ceil(mu / per_pass)

    def prefill_weight_loads(self, mu, n_mb):
        """How often prefill streams the paged weights: once per batch when its passes run
        layer-major (every micro-batch through layer j before layer j+1, as MoE-Lightning and
        FlexGen prefill, prefill_chunk None), else once per pass (the runtime's chunked prefill)."""
        if self.prefill_chunk is None:
            return np.ones_like(np.asarray(mu, float) * np.asarray(n_mb, float))
        return self.prefill_passes(mu, n_mb)

    @property
    def effective_prompt(self) -> float:
        """Prompt tokens per sequence that are computed and cached."""
        if self.padded and self.max_prompt_len:
            return float(self.max_prompt_len)
        return float(self.prompt_len)

    @property
    def computed_prompt(self) -> float:
        """Prompt tokens per sequence that prefill computes and the KV cache stores anew (the shared
        prefix is computed and stored once for all the sequences that share it)."""
        return max(0.0, self.effective_prompt - self.shared_prefix)

    def pool_tokens(self, seqs):
        """Token slots of the KV pool a batch of `seqs` sequences reserves (the memory its KV cache may fill):
        kv_pool's entry for that batch (its last for a larger one), else seqs sequences' own slots and
        kv_pool_shared's prefix once, else seqs * max_context. The pool as the
        engine allocates it, not what its sequences fill: it was found resident in full (2 MiB huge pages a few
        MiB of each head's slots; first-fit pages moving past the prefixes that finished sequences leave named:
        benchmarks/results/memory_planner_check.md)."""
        seqs = np.asarray(seqs, float)
        if not self.kv_pool and self.kv_pool_shared:
            alone, own, once = self.kv_pool_shared  # the prefix once from the first sequence on, or all unshared
            first = min(alone, own + once)
            return np.where(seqs >= 1.0, np.minimum(seqs * alone, seqs * own + once), seqs * first)
        if not self.kv_pool:
            return seqs * self.max_context
        table = np.concatenate([[0.0], np.asarray(self.kv_pool, float)])
        return np.interp(seqs, np.arange(len(table), dtype=float), table)

    @property
    def peak_prompt(self) -> float:
        """Longest prompt a micro-batch may carry (prefill activation sizing): a pass of mixed lengths
        may hold its longest prompts only, padded or not."""
        return float(self.max_prompt_len or self.prompt_len)

    def prefill_pass_tokens(self, mu):
        """Prompt tokens one prefill pass holds at once (its activations): a whole micro-batch
        layer-major, else at most prefill_chunk, and never less than one longest prompt. A micro-batch
        of mixed lengths holds at most its longest prompts, and about the mean each plus one longest
        once it is large (its lengths average out; padded, every prompt is the longest)."""
        mu = np.asarray(mu, float)
        whole = mu * max(1.0, self.peak_prompt)
        if not self.padded:
            whole = np.minimum(whole, mu * self.prompt_len + self.peak_prompt)
        if self.prefill_chunk is None:
            return whole
        return np.minimum(whole, max(float(self.prefill_chunk), self.peak_prompt))

    @property
    def mean_context(self) -> float:
        """Average attention context over the decode steps."""
        return self.effective_prompt + self.gen_len / 2.0

    @property
    def max_context(self) -> float:
        """Context at the last step: what the KV cache must hold per sequence."""
        return self.effective_prompt + self.gen_len

    def to_dict(self) -> dict:
        """The spec's figures (kv_pool, a table as long as the job, as its largest entry)."""
        d = asdict(self)
        d["kv_pool"] = self.kv_pool[-1] if self.kv_pool else None
        return d
