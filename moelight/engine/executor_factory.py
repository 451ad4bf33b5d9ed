"""The executor a planned job runs on: plain CPU, the CGOPipe runtime, or latency mode's expert cache.

The session keeps the executor it built and asks here for a new one only when the next job needs
it (a throughput-mode runtime is reused while its buffers are large enough for the job).
"""

from __future__ import annotations

from dataclasses import replace

from moelight.planning.held_model import held_model_spec
from moelight.planning.job_plan import JobPlan
from moelight.planning.memory_check import available_bytes
from moelight.runtime.executor import Executor


def pipeline_size(plan: JobPlan, prompts, params, turn: int) -> tuple:
    """(r_w, micro-batch, longest prompt, longest context) a CGOPipe runtime must be built for."""
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)) * (2 if turn > 1 else 1)
    return (plan.policy.r_w, plan.micro_batch_size, max(len(p) for p in prompts), longest)


def fits(have: tuple | None, want: tuple) -> bool:
    """A runtime built for `have` serves a job that needs `want` (same r_w, nothing larger)."""
    return have is not None and have[0] == want[0] and all(h >= w for h, w in zip(have[1:], want[1:], strict=True))


def pipeline_executor(model, opts, plan: JobPlan, size: tuple, device: str, ranks: int = 1, group=None) -> Executor:
    """The CGOPipe runtime for this plan; the emulated device takes the planned GPU's memory and link."""
    from moelight.pipeline.pipeline_executor import PipelineExecutor

    hw, micro = plan.hardware, plan.micro_batch_size
    kwargs: dict = {}
    if device == "emulated" and hw.has_gpu:  # one GPU per rank
        kwargs["device_memory"] = int(hw.gpu.memory_bytes * hw.gpu_count / ranks)
        kwargs["h2d_bandwidth"], kwargs["d2h_bandwidth"] = hw.link.h2d, hw.link.d2h
    if group is not None:
        kwargs["compute_in_order"] = True  # every rank issues its all-reduces in one order
        if device == "cuda":
            kwargs["index"] = group.torch_device_index
    policy = replace(plan.policy, batch_size=micro, micro_batch_size=micro, num_micro_batches=1)
    return PipelineExecutor.from_policy(model, policy, opts.schedule, device=device,
                                        max_prefill_tokens=opts.max_prefill_tokens, max_prompt_len=size[2],
                                        max_context=size[3], max_sequences=max(plan.batch_size, micro), **kwargs)


def cache_executor(model, opts, plan: JobPlan, device: str, kv_tokens: int = 4096) -> Executor:
    """Latency mode's executor: a fresh expert cache for every job, on one device. The host copies
    of the experts are page-locked once when the host has room for a second copy of them meanwhile."""
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor
    from moelight.expert_cache.cache_simulator import PassTimer, default_prefetch_budget
    from moelight.expert_cache.eam import EAMCollection
    from moelight.expert_cache.policy_registry import NEEDS_PREDICTOR, make_policy
    from moelight.expert_cache.predictors import Predictors

    cfg, hw = model.config, plan.hardware
    layers, experts = sum(cfg.is_sparse(j) for j in range(cfg.num_layers)), cfg.num_experts
    name, spec = opts.cache_policy_name(), held_model_spec(cfg)
    eamc = EAMCollection.load(opts.eamc, layers, experts) if opts.eamc else None
    predictors = (Predictors.load(opts.predictor, name, layers, experts, cfg.hidden_size)
                  if name in NEEDS_PREDICTOR else None)
    budget = opts.prefetch_per_layer
    if budget is None:
        budget = default_prefetch_budget(hw, spec, plan.batch_size, plan.policy.dtype)
    policy = make_policy(name, layers, experts, eamc, predictors)
    kwargs: dict = {"cpu_max_tokens": PassTimer(hw, spec, plan.policy.dtype).cpu_crossover()
                    if policy.cpu_offload else 0}
    if device == "emulated":
        kwargs |= {"device_memory": int(hw.gpu.memory_bytes), "h2d_bandwidth": hw.link.h2d,
                   "d2h_bandwidth": hw.link.d2h}
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.endswith(("mlp.gate_up_proj", "mlp.down_proj")))
    kwargs["pin_experts"] = available_bytes() > 2 * experts
    return ExpertCacheExecutor(model, plan.info["cache"]["slots"], policy, device, prefetch_per_layer=budget,
                               prefetch_given=opts.prefetch_per_layer is not None, max_tokens=kv_tokens, **kwargs)
