"""One engine behind both front ends: `moelight run` and the Python `LLM` call this, nothing else.

The order is what keeps work and memory safe: options are validated and the model is
resolved (config, tokenizer) without loading it; each job is planned and its memory
checked before the weights are loaded; the weights are loaded once and reused by every
later job of the session; the executor (plain CPU, or the CGOPipe runtime on cuda /
emulated) is built for the plan and rebuilt only when a later job needs larger buffers.

With N > 1 GPUs on cuda / emulated the session is rank 0 of a tensor-parallel group
(moelight/parallel): it spawns the other ranks when it loads, every rank loads its own shard
straight from the checkpoint, and each engine call is replayed on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from cpu_kernels import kernel_backend
from moelight.engine.generation import Engine
from moelight.engine.options import EngineOptions
from moelight.jobs.report import RunReport
from moelight.loading.model_source import load_model, resolve_model
from moelight.parallel import shard_config
from moelight.parallel.rank_group import tensor_parallel_degree
from moelight.planning.job_plan import JobPlan, plan_job, resolve_device
from moelight.planning.memory_check import available_bytes, check_fits, weight_bytes
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams
from moelight.tokenization.tokenizer import ByteTokenizer, load_tokenizer


class EngineSession:
    def __init__(self, opts: EngineOptions, log: Callable[[str], None] | None = None,
                 tensor_parallel=None) -> None:
        """`tensor_parallel`: this process's RankGroup when it is a follower rank (rank 0 makes its own)."""
        opts.validate()
        self.opts, self.log = opts, log
        self.source = resolve_model(opts.model, opts.load_format, opts.dtype)
        self.config = self.source.config
        self.dtype_name = str(self.source.dtype).replace("torch.", "")
        tok_dir = self.source.model_dir if opts.tokenizer != "byte" else None
        self.tokenizer = load_tokenizer(tok_dir, kind="byte" if tok_dir is None else opts.tokenizer,
                                        model_vocab_size=self.config.vocab_size)
        self.device = resolve_device(opts.device)
        self.group = tensor_parallel
        self.ranks = tensor_parallel.world if tensor_parallel else tensor_parallel_degree(opts, self.device)
        if self.ranks > 1:
            shard_config(self.config, self.ranks)  # heads / sizes that N does not divide: say so now
            if opts.gpus is None:  # plan for the GPUs that will run (a preset's count)
                self.opts = replace(opts, gpus=self.ranks)
        # a real tokenizer may add end-of-turn ids; the byte fallback's ids mean nothing to a checkpoint
        tok_eos = () if isinstance(self.tokenizer, ByteTokenizer) and self.source.model_dir else self.tokenizer.eos_ids
        self.eos = tuple(dict.fromkeys(tuple(self.config.eos_token_ids) + tuple(sorted(tok_eos))))
        self.model = None
        self.load_seconds = 0.0
        self._executor = None
        self._executor_size: tuple | None = None  # (r_w, micro, max prompt, max context) it was built for

    # ---- plan -> memory check -> load -> generate ----
    def plan(self, prompts: list[list[int]], params: list[SamplingParams], turn: int = 1) -> JobPlan:
        """Plan the job and check that weights + the largest batch's KV cache fit, before loading."""
        plan = plan_job(self.opts, self.config, self.dtype_name, prompts, params, self.device, self.log, self.ranks)
        plan.info["tensor_parallel"] = self.ranks
        kv_tokens = largest_batch_tokens(prompts, params, plan.batch_size, turn)
        loaded = weight_bytes(self.config, self.source.dtype) if self.model is not None else 0
        check_fits(self.config, self.source.dtype, kv_tokens, available=available_bytes() + loaded)
        return plan

    def load(self) -> None:
        """Load the weights once (the plain CPU executor runs them pre-packed); with N ranks, start
        them, and let each load its own shard (together the shards hold the model once)."""
        if self.model is not None:
            return
        check_fits(self.config, self.source.dtype, 0)
        t0 = time.perf_counter()
        if self.ranks == 1:
            self.model = load_model(self.source, self.opts.seed)
        else:
            self._load_shard()
        if self.device == "cpu":
            pack_model(self.model)
        self.load_seconds = time.perf_counter() - t0

    def _load_shard(self) -> None:
        from moelight.parallel.rank_group import load_together, start_group
        from moelight.parallel.shard_loader import load_shard

        if self.group is None:
            engine_opts = EngineOptions(**{n: getattr(self.opts, n) for n in EngineOptions.names()})
            self.group = start_group(self.ranks, self.device, engine_opts)
        g = self.group
        self.model = load_together(g, lambda: load_shard(self.source, g.rank, g.world, g.all_reduce, self.opts.seed))

    def engine(self, plan: JobPlan, prompts: list[list[int]], params: list[SamplingParams], turn: int = 1):
        """The engine for a planned job, on the plan's executor (rank 0 of N: a LockstepEngine
        that replays each call on the other ranks)."""
        self.load()
        lead = self.group is not None and self.group.rank == 0
        if lead:
            self._send("engine", plan, prompts, params, turn)
        if self.device == "cpu":
            executor = None
        elif plan.info.get("mode") == "latency":
            executor = self._cache_executor(plan)
        else:
            executor = self._pipeline_executor(plan, prompts, params, turn)
        engine = Engine(self.model, self.eos, self.opts.max_prefill_tokens, executor=executor,
                        refill=self.opts.refill)
        if lead:
            from moelight.engine.lockstep import LockstepEngine

            return LockstepEngine(engine, self.group)
        return engine

    def _send(self, command: str, *args) -> None:
        try:
            self.group.send(command, *args)
        except Exception as e:
            error = self.group.failure(e)
            self.group.shutdown()
            if error is e:
                raise
            raise error from e

    def new_report(self, plan: JobPlan | None, requests: int, skipped: int = 0) -> RunReport:
        if plan is None:
            return RunReport(model=self.opts.model, dtype=self.dtype_name, requests=requests, batch_size=0,
                             micro_batch_size=0, skipped_requests=skipped)
        return RunReport(model=self.opts.model, dtype=self.dtype_name, requests=requests,
                         batch_size=plan.batch_size, micro_batch_size=plan.micro_batch_size,
                         skipped_requests=skipped, policy=dict(plan.info), prediction=dict(plan.prediction),
                         attention_backend=kernel_backend())

    def cache_stats(self) -> dict:
        """The latency-mode executor's expert-cache figures (empty in throughput mode)."""
        stats = getattr(self._executor, "stats", None)
        if stats is None:
            return {}
        return stats.to_dict() | {"slots": self._executor.cache.slots, "policy": self._executor.cache.policy.name,
                                  "prefetch_per_layer": self._executor.cache.prefetch_per_layer}

    def _cache_executor(self, plan: JobPlan):
        """Latency mode's executor: a fresh expert cache for every job, on one device."""
        from hrm import model_from_hf_config
        from moelight.expert_cache.cache_simulator import PassTimer, default_prefetch_budget
        from moelight.expert_cache.eam import EAMCollection
        from moelight.expert_cache.executor import ExpertCacheExecutor
        from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, make_policy
        from moelight.expert_cache.predictors import Predictors

        cfg, hw = self.config, plan.hardware
        layers, experts = sum(cfg.is_sparse(j) for j in range(cfg.num_layers)), cfg.num_experts
        name, spec = self.opts.cache_policy_name(), model_from_hf_config(cfg.to_hf_dict())
        eamc = EAMCollection.load(self.opts.eamc, layers, experts) if self.opts.eamc else None
        predictors = (Predictors.load(self.opts.predictor, name, layers, experts, cfg.hidden_size)
                      if name in NEEDS_PREDICTOR else None)
        budget = self.opts.prefetch_per_layer
        if budget is None:
            budget = default_prefetch_budget(hw, spec, plan.batch_size, plan.policy.dtype)
        policy = make_policy(name, layers, experts, eamc, predictors)
        kwargs: dict = {"cpu_max_tokens": PassTimer(hw, spec, plan.policy.dtype).cpu_crossover()
                        if policy.cpu_offload else 0}
        if self.device == "emulated":
            kwargs |= {"device_memory": int(hw.gpu.memory_bytes), "h2d_bandwidth": hw.link.h2d,
                       "d2h_bandwidth": hw.link.d2h}
        self.close_executor()
        self._executor = ExpertCacheExecutor(self.model, plan.info["cache"]["slots"], policy, self.device,
                                             prefetch_per_layer=budget, **kwargs)
        self._executor_size = None  # a throughput-mode job after this one builds its own
        return self._executor

    def close_executor(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    def close(self) -> None:
        """Free the device; rank 0 also ends the other ranks (the session cannot generate after)."""
        self.close_executor()
        if self.group is not None and self.group.rank == 0:
            self.group.shutdown()

    def _pipeline_executor(self, plan: JobPlan, prompts, params, turn: int):
        """The CGOPipe runtime for this plan; the emulated device takes the planned GPU's memory and link.

        Reused while its buffers are large enough for the job (same r_w, no larger micro-batch,
        prompt or context); otherwise rebuilt.
        """
        from moelight.pipeline.executor import PipelineExecutor

        hw, micro = plan.hardware, plan.micro_batch_size
        longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)) * (2 if turn > 1 else 1)
        want = (plan.policy.r_w, micro, max(len(p) for p in prompts), longest)
        have = self._executor_size
        if have is not None and have[0] == want[0] and all(h >= w for h, w in zip(have[1:], want[1:], strict=True)):
            return self._executor
        self.close_executor()
        kwargs: dict = {}
        if self.device == "emulated" and hw.has_gpu:  # one GPU per rank
            kwargs["device_memory"] = int(hw.gpu.memory_bytes * hw.gpu_count / self.ranks)
            kwargs["h2d_bandwidth"], kwargs["d2h_bandwidth"] = hw.link.h2d, hw.link.d2h
        if self.group is not None:
            kwargs["compute_in_order"] = True  # every rank issues its all-reduces in one order
            if self.device == "cuda":
                kwargs["index"] = self.group.torch_device_index
        policy = replace(plan.policy, batch_size=micro, micro_batch_size=micro, num_micro_batches=1)
        self._executor = PipelineExecutor.from_policy(
            self.model, policy, self.opts.schedule, device=self.device,
            max_prefill_tokens=self.opts.max_prefill_tokens, max_prompt_len=want[2], max_context=want[3], **kwargs,
        )
        self._executor_size = want
        return self._executor


def largest_batch_tokens(prompts, params, batch_size: int, turn: int = 1) -> int:
    """KV slots of the largest batch (prompt + max new tokens per sequence), with room for turn 2."""
    sizes = [len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)]
    worst = sum(sorted(sizes, reverse=True)[:batch_size])
    return worst * (2 if turn > 1 else 1)
