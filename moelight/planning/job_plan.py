"""Planning a job before anything is loaded: hardware, device, policy, prediction.

Both front ends (`moelight run`, `LLM.generate`) plan through `plan_job`, so a job gets the
same batch, micro-batch, placement and HRM prediction whichever way it was started.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from moelight.planning.hardware_choice import PlanError, hardware_for_device
from moelight.planning.held_model import held_model_spec
from moelight.planning.memory_check import OutOfMemoryPlan, check_fits, cpu_engine_extra_bytes, run_sizes
from moelight.planning.mode_choice import ModeError, apply_mode
from moelight.planning.quantize_advice import planned_text, quantize_advice
from moelight.planning.size_overrides import check_sizes_fit
from moelight.runtime.paged_layout import pool_table, shared_prefix_tokens
from moelight.sampling.params import SamplingParams

if TYPE_CHECKING:  # the engine's options type the argument; planning runs below the engine
    from moelight.engine.options import EngineOptions
    from moelight.models.config import ModelConfig


@dataclass
class JobPlan:
    """What runs: the sizes, the policy and hardware behind them, the report's policy and prediction."""

    batch_size: int
    micro_batch_size: int
    policy: object  # optimizer.Policy, fitted to the job
    hardware: object  # hrm.HardwareSpec
    info: dict  # report.policy
    prediction: dict  # report.prediction
    solved: object = None  # the policy as solved for the job's hardware, before it was fitted to the job
    workload: object = None  # hrm.WorkloadSpec the plan was made for (the memory check counts its pool too)


def workload_of(prompts: list[list[int]], params: list[SamplingParams], prefill_chunk: int | None = None,
                prefix_sharing: bool = False, turn: int = 1):
    """The HRM workload of a tokenized job: mean / max prompt length, mean generation length, the
    engine's prefill passes (at most prefill_chunk tokens each, every one streaming the weights),
    with prefix sharing the mean prompt tokens a shared prefix serves, the KV pool the engine
    reserves for each batch size (kv_pool_table), and whether every request takes its argmax (greedy,
    nothing else asked of its logits: the sampler then copies none)."""
    from hrm import WorkloadSpec

    lens = [len(p) for p in prompts] or [1]
    gen = math.ceil(sum(q.max_tokens for q in params) / max(1, len(params))) if params else 1
    shared = 0.0
    if prefix_sharing and prompts:
        share = [q.prompt_logprobs is None for q in params] if params else [True] * len(prompts)
        shared = sum(shared_prefix_tokens(prompts, share)) / len(prompts)
    argmax_only = bool(params) and all(q.greedy and not q.has_processors and q.logprobs is None
                                       and q.prompt_logprobs is None for q in params)
    return WorkloadSpec(sum(lens) / len(lens), max(1, gen), max(lens), prefill_chunk=prefill_chunk,
                        shared_prefix=shared, kv_pool=kv_pool_table(prompts, params, prefix_sharing, turn),
                        argmax_only=argmax_only)


def kv_pool_table(prompts: list[list[int]], params: list[SamplingParams], paged: bool,
                  turn: int = 1) -> tuple[int, ...] | None:
    """Token slots of the KV pool the engine allocates for a batch of 1, 2, ... len(prompts) sequences
    (engine/scheduler.py: runtime/paged_layout.pool_table; paged, each shared prefix once per distinct prefix
    live at once), doubled from turn 2 on (room for the next turn, as the checks before loading have counted
    it); None without params (no generation length to size it by)."""
    if not prompts or len(params) != len(prompts):
        return None
    rooms = [len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)]
    share = [q.prompt_logprobs is None for q in params]
    table = pool_table(rooms, paged, prompts if paged else None, share)
    return tuple(n * (2 if turn > 1 else 1) for n in table)


def plan_job(opts: EngineOptions, cfg: ModelConfig, dtype: str, prompts, params, device: str,
             log: Callable[[str], None] | None = None, ranks: int = 1, solved=None,
             host_available: int | None = None, host_in_use: int = 0, turn: int = 1) -> JobPlan:
    """The policy for this job: planned (auto), read from a file, or `solved` already for the same
    model, hardware and workload (a Ray replica reuses its driver's), capped to the number of
    requests; explicit batch / micro-batch sizes win; then the mode (throughput or latency,
    planning/mode_choice.py); the prediction is for what runs. `host_available`: the host memory free for
    the job now, which a plan for this machine (`--hardware profile`, the default) plans against;
    `host_in_use`: what this process needs beside the model, off the host memory a file or preset declares;
    `turn`: the conversation turn the job generates (from 2 on its KV pool keeps room for the next)."""
    from optimizer import InfeasibleError, Policy, fit_policy, plan, predict_job

    n_req = len(prompts)
    no_throughput = ""  # why throughput mode cannot run, where its runtime's placement does not fit
    hw = hardware_for_device(opts.hardware, device, log, host_available, host_in_use)
    if opts.gpus is not None:
        try:
            hw = hw.with_gpus(opts.gpus)
        except ValueError as e:
            raise PlanError(f"--gpus {opts.gpus}: {e}") from None
    _check_dtype_rates(hw, dtype, opts.hardware)
    mspec = _planned_spec(cfg, opts.model, device, dtype)
    sharing = opts.enable_prefix_caching  # every executor pages K and V caches and MLA's latent alike
    workload = workload_of(prompts, params, opts.max_prefill_tokens, sharing, turn)
    t0 = time.perf_counter()
    if solved is not None:
        planned, source = replace(solved, dtype=dtype), "auto"  # solved once for the job (a Ray driver)
    elif opts.policy == "auto":
        family = _runtime_family(device, opts.schedule, hw)

        def refusal(e: Exception) -> PlanError:
            advice = quantize_note(opts, cfg, dtype, hw, workload, device, ranks, n_req, host_available)
            return PlanError(f"the job does not fit: {e}{_held_note(e, host_in_use)}{advice}")

        try:  # only the placement the device's runtime executes: its memory check must hold for what runs
            planned = plan(hw, mspec, workload, dtype, family=family).policy
        except InfeasibleError as e:
            if family == "moelight" or opts.mode == "throughput":
                raise refusal(e) from None
            # latency mode may still run (its own fit check): the throughput plan is only its reference
            no_throughput = f"throughput mode does not fit: {e}"
            try:
                planned = plan(hw, mspec, workload, dtype).policy
            except InfeasibleError:
                raise refusal(e) from None
        except ValueError as e:  # a GPU count the model's heads or expert width cannot be split into
            raise PlanError(str(e)) from None
        source = "auto"
    else:
        try:
            planned = replace(Policy.load(opts.policy), dtype=dtype)
        except FileNotFoundError:
            raise PlanError(f"--policy {opts.policy}: no such file") from None
        except (ValueError, TypeError, KeyError) as e:  # bad JSON, missing fields, N != mu x n_mb
            raise PlanError(f"--policy {opts.policy}: not a policy JSON ({e})") from None
        source = str(opts.policy)
    plan_s = time.perf_counter() - t0
    if (planned.attn_on_gpu or planned.ffn_on_gpu) and device == "cpu":
        _no_gpu_runtime(planned, opts.device)
    if device != "cpu" and not no_throughput:
        _check_runtime_placement(planned, opts.schedule, source)
    policy = fit_policy(planned, n_req)
    if source not in ("auto",):  # a policy from a file: it must fit the same memory model the planner obeys
        check_policy_fits(policy, hw, mspec, workload, f"--policy {opts.policy}")
    batch = opts.batch_size or policy.batch_size
    micro = min(opts.micro_batch_size or policy.micro_batch_size, batch)
    if opts.batch_size or opts.micro_batch_size:  # sizes the planner did not pick: the same fit check as a file's
        check_sizes_fit(policy, hw, mspec, workload, batch, micro, n_req, bool(opts.batch_size),
                        bool(opts.micro_batch_size))
    ran = policy.to_dict() | {"batch_size": batch, "micro_batch_size": micro,
                              "num_micro_batches": math.ceil(min(batch, n_req) / micro)}
    info = ran | {"source": source, "hardware": hw.name, "plan_seconds": plan_s,
                  "workload": workload.to_dict(), "device": device,
                  "batching": "refill" if opts.refill else "static"}
    if device != "cpu":
        info["schedule"] = opts.schedule
    if hw.measured_at:  # the report says how old the profile behind the prediction is (a host's speed drifts)
        info["hardware_measured_at"] = hw.measured_at
    if no_throughput:
        info["no_throughput"] = no_throughput  # apply_mode: latency mode or nothing
    if solved is not None:
        info["solved_once"] = True  # the policy came solved for this hardware, not solved again
    if ran["batch_size"] != planned.batch_size or ran["micro_batch_size"] != planned.micro_batch_size:
        info["planned"] = planned.to_dict()
    pred = predict_job(hw, mspec, workload, policy, n_req, batch, micro)
    try:
        plan = apply_mode(JobPlan(batch, micro, policy, hw, info, pred, planned, workload), opts, mspec, workload,
                          n_req, device, ranks)
    except ModeError as e:
        raise PlanError(str(e)) from None
    if log:
        p = plan.prediction
        where = ("expert cache of " f"{plan.info['cache']['slots']} slots ({plan.info['cache']['policy']})"
                 if plan.info["mode"] == "latency" else _placement(policy))
        log(f"policy ({source}, {plan_s * 1e3:.0f} ms, hardware {hw.name}): batch {plan.batch_size}, micro-batch "
            f"{plan.micro_batch_size}, {where}; predicted {p['end_to_end_tokens_per_s']:.1f} tok/s end-to-end, "
            f"bound by {p['binding']}; {plan.info['mode_reason']}")
        if plan.info.get("warning"):
            log(f"warning: {plan.info['warning']}")
    return plan


def quantize_note(opts: EngineOptions, cfg: ModelConfig, dtype: str, hw, workload, device: str, ranks: int,
                  requests: int, host_available: int | None) -> str:
    """For a refusal of a job with 16-bit experts: whether --quantize int8 or int4 would fit, by the planner and
    (with the host's memory known) the check before loading, its batch and predicted rate ("" where the user
    gave --quantize or the checkpoint ships its experts quantized)."""
    from optimizer import InfeasibleError, fit_policy, plan, predict_job

    family = _runtime_family(device, opts.schedule, hw)

    def fits(held: ModelConfig) -> str | None:
        spec = _planned_spec(held, opts.model, device, dtype)
        try:
            policy = fit_policy(plan(hw, spec, workload, dtype, family=family).policy, requests)
            if host_available is not None:  # as the session checks it, without the optional plain copies
                check_fits(held, getattr(torch, dtype), available=host_available, ranks=ranks,
                           on_cpu=device == "cpu", plain_weights=False,
                           **run_sizes(workload, requests, policy.batch_size, policy.micro_batch_size))
        except (InfeasibleError, OutOfMemoryPlan):
            return None
        pred = predict_job(hw, spec, workload, policy, requests, policy.batch_size, policy.micro_batch_size)
        return planned_text(policy.batch_size, pred["end_to_end_tokens_per_s"])

    return quantize_advice(cfg, opts.quantize, ranks, fits)


def _planned_spec(cfg: ModelConfig, name: str, device: str, dtype: str):
    """hrm.ModelSpec the planner prices: the experts as held (quantized: the bytes they read, page and hold) and,
    on the CPU, the engine's float32 copies where it makes them."""
    mspec = held_model_spec(cfg, name)
    if device == "cpu":
        mspec = replace(mspec, host_weight_extra_bytes=float(cpu_engine_extra_bytes(cfg, getattr(torch, dtype), True)))
    return mspec


def check_policy_fits(policy, hw, mspec, workload, what: str) -> None:
    """PlanError naming what does not fit, and by how much, when `policy` breaks the HRM's memory model on `hw`."""
    from optimizer import evaluate_policy

    problems = evaluate_policy(hw, mspec, workload, policy).memory_problems()
    if problems:
        raise PlanError(f"{what} does not fit {hw.name} (N={policy.batch_size}, r_w={policy.r_w:.3f}, "
                        f"r_c={policy.r_c:.3f}):\n  " + "\n  ".join(problems)
                        + "\nplan one that fits with `moelight plan`, or lower its batch size or r_w")


def _held_note(e: Exception, held: int) -> str:
    """Where the CPU memory is short: that the usable figure is net of this process's own memory."""
    from optimizer.policy import size_text

    if not held or "CPU memory" not in str(e):
        return ""
    return (f" (the CPU memory usable is net of the {size_text(held)} this process needs beside the model: torch, "
            "the tokenizer, the engine's runtime)")


def _placement(policy) -> str:
    if not (policy.attn_on_gpu or policy.ffn_on_gpu):
        return "all on CPU"
    return (f"attention on {'GPU' if policy.attn_on_gpu else 'CPU'}, FFN on {'GPU' if policy.ffn_on_gpu else 'CPU'}, "
            f"r_w {policy.r_w:.3f}")


def _check_dtype_rates(hw, dtype: str, hardware: str | None) -> None:
    """PlanError, before anything loads, for a hardware file without the FLOP/s a `dtype` plan looks up."""
    from hrm.hardware_checks import dtype_rate_problem
    from hrm.hardware_presets import DEFAULT_PROFILE_PATH

    problem = dtype_rate_problem(hw, dtype)
    if problem:
        source = hardware if hardware and hardware.lower() != "profile" else DEFAULT_PROFILE_PATH
        raise PlanError(f"--hardware {source}: {problem}")


def _runtime_family(device: str, schedule: str, hw) -> str:
    """The optimizer's policy family of what runs: on a device, the one placement of `--schedule`
    (the runtime has no executor for the others, e.g. attention on the GPU with the FFN on the CPU)."""
    from moelight.pipeline.schedule import SCHEDULE_FAMILY

    return SCHEDULE_FAMILY[schedule] if device != "cpu" and hw.has_gpu else "moelight"


def _check_runtime_placement(policy, schedule: str, source: str) -> None:
    """PlanError when a policy file places attention / the FFN where the device's runtime does not run them."""
    from moelight.pipeline.schedule import SCHEDULE_FAMILY
    from optimizer.search import FAMILIES

    runs = FAMILIES[SCHEDULE_FAMILY[schedule]][0]
    if (int(policy.attn_on_gpu), int(policy.ffn_on_gpu)) != runs:
        raise PlanError(
            f"{source}: the policy places attention on {'GPU' if policy.attn_on_gpu else 'CPU'} and the MoE FFN "
            f"on {'GPU' if policy.ffn_on_gpu else 'CPU'}, but --schedule {schedule} runs attention on "
            f"{'GPU' if runs[0] else 'CPU'} and the FFN on {'GPU' if runs[1] else 'CPU'}; plan one for it "
            f"(`moelight plan --family {SCHEDULE_FAMILY[schedule]}`) or pick the schedule of its placement")


def _no_gpu_runtime(policy, asked: str) -> None:
    placed = (("attention", policy.attn_on_gpu), ("the MoE FFN", policy.ffn_on_gpu))
    where = " and ".join(name for name, on in placed if on)
    raise PlanError(
        f"the policy puts {where} on the GPU, but --device {asked} runs on the CPU; use --device cuda on a "
        "GPU host or --device emulated to run the CGOPipe runtime on an emulated accelerator, or plan for "
        "the CPU with --gpus 0 (or a CPU --hardware)"
    )
