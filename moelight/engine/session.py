"""One loaded model and its executor, behind every front end (`moelight run`, `LLM`, a Ray replica).

The order is what keeps work and memory safe: options are validated and the model is
resolved (config, tokenizer) without loading it; each job is planned and its memory
checked before the weights are loaded; the weights are loaded once and reused by every
later job of the session; the executor (plain CPU, the CGOPipe runtime on cuda / emulated,
or latency mode's expert cache) is built for the plan and rebuilt only when a later job needs
larger buffers (engine/executor_factory.py). The job's report is the job's (moelight/jobs/).

With N > 1 GPUs on cuda / emulated the session is rank 0 of a tensor-parallel group
(moelight/parallel): it spawns the other ranks when it loads, every rank loads its own shard
straight from the checkpoint, and each engine call is replayed on every rank (engine/lockstep.py,
engine/tp_follower.py); front ends open a session with engine/session_start.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from cpu_kernels.dispatch import SMALL_LINEAR_ROWS
from moelight.engine import executor_factory
from moelight.engine.generation import Engine
from moelight.engine.options import EngineOptions, OptionError
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.model_source import load_model
from moelight.loading.resolved_model import ResolvedModel, resolve
from moelight.models.fused_dequant import mode as dequant_gemm_mode
from moelight.parallel import shard_config
from moelight.parallel.rank_group import tensor_parallel_degree
from moelight.planning.hardware_choice import resolve_device
from moelight.planning.job_plan import JobPlan, plan_job, quantize_note
from moelight.planning.memory_check import (
    OutOfMemoryPlan,
    available_bytes,
    check_fits,
    held_before_job,
    run_sizes,
    weight_bytes,
)
from moelight.planning.size_overrides import largest_size
from moelight.runtime.cpu_linear import keeps_plain_weights, pack_model, weights_on_huge_pages
from moelight.runtime.executor import Executor
from moelight.runtime.paged_layout import pool_slots
from moelight.sampling.checks import SamplingChecker
from moelight.sampling.params import SamplingParams

# a spawned rank's entry point, by name: the launcher imports it in the new process (engine/tp_follower.py)
FOLLOWER_MAIN = "moelight.engine.tp_follower:serve"

__all__ = ["EngineSession", "tensor_parallel_degree"]


class EngineSession:
    def __init__(self, opts: EngineOptions, log: Callable[[str], None] | None = None,
                 tensor_parallel=None, resolved: ResolvedModel | None = None) -> None:
        """`tensor_parallel`: this process's RankGroup when it is a follower rank (rank 0 makes its own);
        `resolved`: the model already resolved in this process (its tokenizer is reused)."""
        opts.validate()
        self.opts, self.log = opts, log
        self.resolved = resolved or resolve(opts.model, opts.load_format, opts.dtype, opts.tokenizer)
        self.source, self.config = self.resolved.source, self.resolved.config
        self.tokenizer, self.eos, self.dtype_name = self.resolved.tokenizer, self.resolved.eos, self.resolved.dtype_name
        self.device = resolve_device(opts.device)
        if opts.device == "auto" and self.device == "cpu" and opts.schedule != "cgopipe" and log:
            log(f"--schedule {opts.schedule} is unused: --device auto found no GPU, so the plain CPU executor runs "
                "(--device emulated runs the schedule on an emulated GPU)")
        if self.device == "cuda":
            self._fit_dtype_to_gpu()
        self.group = tensor_parallel
        self.ranks = tensor_parallel.world if tensor_parallel else tensor_parallel_degree(opts, self.device)
        if self.ranks > 1:
            shard_config(self.config, self.ranks)  # heads / sizes that N does not divide: say so now
        self._choose_expert_format()  # quantization groups that fit a rank's columns
        self._check_cache_options()
        if self.ranks > 1 and opts.gpus is None:  # plan for the GPUs that will run (a preset's count)
            self.opts = replace(opts, gpus=self.ranks)
        self.model = None
        self.load_seconds = 0.0
        self.plain_weights = True  # the loaded model keeps plain bf16 weights (cpu_linear.keeps_plain_weights)
        self.plain_allowed = True  # False once those copies did not fit beside a small job's weights (plan)
        self._executor: Executor | None = None
        self._executor_size: tuple | None = None  # what a reusable CGOPipe runtime was built for
        self.sampling = SamplingChecker(self.tokenizer, self.config.vocab_size, self.eos)

    def _check_cache_options(self) -> None:
        """The expert cache's options against the model, once its config is known rather than after a
        job's dataset read and plan: --cache-size below one layer's experts, an --eamc or --predictor file
        that is corrupt or made for another model."""
        from moelight.expert_cache.eam import EAMCollection, EAMError
        from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR
        from moelight.expert_cache.predictors import PredictorError, Predictors
        from moelight.planning.mode_choice import cache_too_small

        opts, cfg = self.opts, self.config
        layers, experts = sum(cfg.is_sparse(i) for i in range(cfg.num_layers)), cfg.num_experts
        too_small = opts.cache_size is not None and cache_too_small(opts.cache_size, layers * experts, experts)
        if too_small:
            raise OptionError(too_small)
        try:
            if opts.eamc is not None:
                EAMCollection.load(Path(opts.eamc).expanduser(), layers, experts)
            if opts.predictor is not None and opts.cache_policy_name() in NEEDS_PREDICTOR:
                Predictors.load(Path(opts.predictor).expanduser(), opts.cache_policy_name(), layers, experts,
                                cfg.hidden_size)
        except EAMError as e:
            raise OptionError(f"--eamc {e}") from None
        except PredictorError as e:
            raise OptionError(f"--predictor {e}") from None

    def _fit_dtype_to_gpu(self) -> None:
        """float16 where the GPU has no bfloat16 arithmetic and the dtype was left to moelight."""
        import torch

        from moelight.planning.hardware_choice import cuda_dtype_advice

        dtype, note = cuda_dtype_advice(self.opts.dtype, self.dtype_name, torch.cuda.get_device_capability())
        if dtype is not None:
            self.resolved = resolve(self.opts.model, self.opts.load_format, dtype, self.opts.tokenizer)
            self.source, self.dtype_name = self.resolved.source, self.resolved.dtype_name
        if note and self.log:
            self.log(note)

    def _choose_expert_format(self) -> None:
        """Hold the routed experts quantized from load on (--quantize, or a quantized checkpoint kept as
        shipped on the CPU): the memory check and the loader then see the smaller experts."""
        method, group = self.opts.quantization()
        cfg = with_expert_format(self.config, self.source.dtype, self.device, method, group, self.ranks,
                                 self.opts.quantize)
        self.resolved = replace(self.resolved, source=replace(self.source, config=cfg))
        self.source, self.config = self.resolved.source, cfg
        if cfg.expert_format is not None and self.device != "cpu":  # a device runtime reads it once built
            try:
                dequant_gemm_mode()
            except ValueError as e:
                raise OptionError(f"{e}; set it to one of them or unset it (auto)") from None
        if cfg.expert_format is not None and self.log:
            self.log(f"routed experts held as {cfg.expert_format.fmt} ({cfg.expert_format.origin})")

    # ---- plan -> memory check -> load -> generate ----
    def plan(self, prompts: list[list[int]], params: list[SamplingParams], turn: int = 1,
             solved=None) -> JobPlan:
        """Plan the job and check, before loading, that its weights, KV pool and activations fit (the planner
        counts the same bytes: plan.workload). `solved`: a policy already solved for this job's hardware (the Ray
        driver's), fitted not re-solved."""
        on_cpu = self.device == "cpu"
        loaded = (weight_bytes(self.config, self.source.dtype, on_cpu, self.plain_weights)
                  if self.model is not None else 0)
        available = available_bytes() + loaded  # what this job can have: free memory and the model it holds
        held = held_before_job(loaded)  # torch, the runtime, the tokenizer: no HRM term counts them
        plan = plan_job(self.opts, self.config, self.dtype_name, prompts, params, self.device, self.log,
                        self.ranks, solved=solved, host_available=available, host_in_use=held, turn=turn)
        plan.info["host_in_use"] = held
        plan.info["tensor_parallel"] = self.ranks
        try:
            self._check_before_loading(plan, len(prompts), available)
        except OutOfMemoryPlan as e:
            if self.opts.batch_size or plan.info["source"] != "auto":
                raise self._with_quantize_note(e, plan, len(prompts), available) from None
            try:
                plan = self._capped(plan, prompts, params, turn, solved, available, held)
            except OutOfMemoryPlan as capped:
                raise self._with_quantize_note(capped, plan, len(prompts), available) from None
        return plan

    def _check_before_loading(self, plan: JobPlan, requests: int, available: int) -> None:
        """check_fits for the plan's batch. The plain bf16 copies a job of a few sequences keeps are a speed-up of
        its few-row steps: where they alone do not fit, the job loads without them rather than being refused."""
        sizes = run_sizes(plan.workload, requests, plan.batch_size, plan.micro_batch_size)

        def check(plain: bool) -> None:
            check_fits(self.config, self.source.dtype, available=available, ranks=self.ranks,
                       on_cpu=self.device == "cpu", hint=self._batch_hint(plan), plain_weights=plain, **sizes)

        plain = self._plain_for(plan.batch_size)
        try:
            check(plain)
        except OutOfMemoryPlan:
            if not (plain and self.model is None):
                raise
            check(False)
            self.plain_allowed = False
            if self.log:
                self.log("the plain bf16 weight copies that speed up few-row steps do not fit beside the weights: "
                         "loading without them")

    def _with_quantize_note(self, e: OutOfMemoryPlan, plan: JobPlan, requests: int, available: int) -> OutOfMemoryPlan:
        """The check's refusal, and whether --quantize int8 or int4 would have fit (planning.job_plan.quantize_note)."""
        note = quantize_note(self.opts, self.config, self.dtype_name, plan.hardware, plan.workload, self.device,
                             self.ranks, requests, available)
        return OutOfMemoryPlan(f"{e}{note}") if note else e

    def _batch_hint(self, plan: JobPlan) -> str:
        """What to lower when the batch's KV cache does not fit: the option or file that set its size."""
        if self.opts.batch_size or plan.info["source"] == "auto":
            return "use a smaller --batch-size"
        return f"lower the batch size of --policy {plan.info['source']} or set a smaller --batch-size"

    def _capped(self, plan: JobPlan, prompts, params, turn: int, solved, available: int, held: int) -> JobPlan:
        """The automatic plan with its batch capped to what the memory check accepts, said in the log and the
        report; the check's error if none fits. The planner counts the check's bytes, so this happens where they
        see different memory: a --hardware file or preset declaring more than is available now, or a policy
        solved on another host (`solved`)."""
        from optimizer.policy import size_text

        on_cpu = self.device == "cpu"

        def check(batch: int) -> None:
            check_fits(self.config, self.source.dtype, available=available, ranks=self.ranks, on_cpu=on_cpu,
                       plain_weights=self._plain_for(batch),
                       **run_sizes(plan.workload, len(prompts), batch, plan.micro_batch_size))

        def fits(batch: int) -> bool:
            try:
                check(batch)
            except OutOfMemoryPlan:
                return False
            return True

        # a batch of up to SMALL_LINEAR_ROWS keeps plain bf16 copies (keeps_plain_weights), so memory grows with
        # the batch on each side of that size but not across it: the larger batches are searched first
        high, small = plan.batch_size - 1, SMALL_LINEAR_ROWS
        above = largest_size(lambda b: fits(small + b), high - small) if high > small else 0
        batch = small + above if above else largest_size(fits, min(high, small))
        if not batch:  # not even one sequence beside the weights: the check says why (for the lighter weights)
            check(min(high, small + 1))
        if self.log:
            self.log(f"the automatic batch of {plan.batch_size} does not fit the host memory available now "
                     f"({size_text(available)}) by the check before loading: capped at {batch}")
        capped = plan_job(replace(self.opts, batch_size=batch), self.config, self.dtype_name, prompts, params,
                          self.device, None, self.ranks, solved=solved, host_available=available,
                          host_in_use=held, turn=turn)
        capped.info |= {"tensor_parallel": self.ranks, "host_in_use": held,
                        "batch_capped": {"planned": plan.batch_size, "ran": batch}}
        return capped

    def load(self, batch_size: int | None = None) -> None:
        """Load the weights once (the plain CPU executor runs them pre-packed, on huge pages where a decode
        step of `batch_size` rows streams them: cpu_linear.weights_on_huge_pages); with N ranks, start
        them, and let each load its own shard (together the shards hold the model once)."""
        if self.model is not None:
            return
        plain = self._plain_for(batch_size)
        check_fits(self.config, self.source.dtype, 0, on_cpu=self.device == "cpu", plain_weights=plain)
        t0 = time.perf_counter()
        if self.ranks == 1:
            self.model = load_model(self.source, self.opts.seed)
        else:
            self._load_shard()
        if self.device == "cpu":
            method, group = self.opts.quantization()
            huge = weights_on_huge_pages(batch_size, self.config.top_k, self.config.num_experts)
            pack_model(self.model, method, group, huge_pages=huge, plain_weights=plain)
        self.plain_weights = plain
        self.load_seconds = time.perf_counter() - t0

    def _plain_for(self, batch_size: int | None) -> bool:
        """Whether a job of `batch_size` keeps the plain bf16 weights (cpu_linear.keeps_plain_weights); a model
        already loaded keeps what it was loaded with."""
        if self.model is not None:
            return self.plain_weights
        return self.plain_allowed and keeps_plain_weights(batch_size)

    def _load_shard(self) -> None:
        from moelight.parallel.rank_group import load_together, start_group
        from moelight.parallel.shard_loader import load_shard

        if self.group is None:
            engine_opts = EngineOptions(**{n: getattr(self.opts, n) for n in EngineOptions.names()})
            self.group = start_group(self.ranks, self.device, engine_opts, FOLLOWER_MAIN, log=self.log)
        g = self.group
        self.model = load_together(g, lambda: load_shard(self.source, g.rank, g.world, g.all_reduce, self.opts.seed))

    def engine(self, plan: JobPlan, prompts: list[list[int]], params: list[SamplingParams], turn: int = 1):
        """The engine for a planned job, on the plan's executor (rank 0 of N: a LockstepEngine
        that replays each call on the other ranks)."""
        self.load(plan.batch_size)
        lead = self.group is not None and self.group.rank == 0
        if lead:
            self._send("engine", plan, prompts, params, turn)
        engine = Engine(self.model, self.eos, self.opts.max_prefill_tokens, executor=self._executor_for(
            plan, prompts, params, turn), refill=self.opts.refill, tokenizer=self.tokenizer,
            prefix_sharing=self.opts.enable_prefix_caching,
            grammars=self.sampling.grammars if any(p.structured_outputs for p in params) else None,
            share_tokens=self.group.share_tokens if self.group is not None else None,
            listed_eos=self.resolved.listed_eos)
        if lead:
            from moelight.engine.lockstep import LockstepEngine

            return LockstepEngine(engine, self.group)
        return engine

    def _executor_for(self, plan: JobPlan, prompts, params, turn: int) -> Executor | None:
        """The plan's executor: None (the engine's plain CPU one), a fresh expert cache for every
        latency-mode job, or a CGOPipe runtime reused while its buffers are large enough."""
        if self.device == "cpu":
            return None
        if plan.info.get("mode") == "latency":
            self.close_executor()
            self._executor = executor_factory.cache_executor(
                self.model, self.opts, plan, self.device, largest_batch_tokens(prompts, params, plan.batch_size, turn))
            return self._executor
        want = executor_factory.pipeline_size(plan, prompts, params, turn)
        if not executor_factory.fits(self._executor_size, want):
            self.close_executor()
            self._executor = executor_factory.pipeline_executor(self.model, self.opts, plan, want, self.device,
                                                                self.ranks, self.group)
            self._executor_size = want
        return self._executor

    def _send(self, command: str, *args) -> None:
        try:
            self.group.send(command, *args)
        except Exception as e:
            error = self.group.failure(e)
            self.group.shutdown()
            if error is e:
                raise
            raise error from e

    def check_sampling(self, params: list[SamplingParams]) -> None:
        """Every request's sampling checked against this model before anything loads (sampling/checks.py)."""
        for i, p in enumerate(params):
            try:
                self.sampling.check(p)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None

    def executor_stats(self) -> dict:
        """The executor's figures for the job's report (latency mode's expert cache; {} otherwise)."""
        return self._executor.stats() if self._executor is not None else {}

    def close_executor(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None
            self._executor_size = None

    def close(self) -> None:
        """Free the device; rank 0 also ends the other ranks (the session cannot generate after)."""
        self.close_executor()
        if self.group is not None and self.group.rank == 0:
            self.group.shutdown()


def largest_batch_tokens(prompts, params, batch_size: int, turn: int = 1) -> int:
    """KV slots of the largest batch (prompt + max new tokens per sequence, unpaged), with room for turn 2: a
    device executor's buffers (the memory check counts the pool the engine allocates: plan.workload)."""
    sizes = [len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)]
    return pool_slots(sizes, batch_size, paged=False) * (2 if turn > 1 else 1)
