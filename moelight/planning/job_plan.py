"""Planning a job before anything is loaded: hardware, device, policy, prediction.

Both front ends (`moelight run`, `LLM.generate`) plan through `plan_job`, so a job gets the
same batch, micro-batch, placement and HRM prediction whichever way it was started.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from moelight.engine.options import EngineOptions
from moelight.errors import MoelightError
from moelight.planning.mode_choice import ModeError, apply_mode
from moelight.sampling.params import SamplingParams


class PlanError(MoelightError):
    """The policy cannot run: it does not fit, it cannot be read, or it needs a missing GPU."""


@dataclass
class JobPlan:
    """What runs: the sizes, the policy and hardware behind them, the report's policy and prediction."""

    batch_size: int
    micro_batch_size: int
    policy: object  # optimizer.Policy, fitted to the job
    hardware: object  # hrm.HardwareSpec
    info: dict  # report.policy
    prediction: dict  # report.prediction


def resolve_hardware(name: str | None, log: Callable[[str], None] | None = None):
    """The HardwareSpec to plan with: a preset, a profile JSON, or the cached profile.

    With no cached profile, or one from an older moelight that lacks a measurement the HRM
    now uses, a quick profile (a few seconds) is taken now and cached, so the plan always
    describes this machine and the next run starts at once.
    """
    from hrm import hardware_presets

    key = name or "profile"
    cached = hardware_presets.DEFAULT_PROFILE_PATH.expanduser()
    if key.lower() == "profile" and (not cached.is_file() or _profile_is_stale(cached)):
        from moelight.profiling.machine_profile import profile_machine

        why = "an older moelight's profile" if cached.is_file() else "no hardware profile yet"
        t0 = time.perf_counter()
        hw = profile_machine(quick=True)
        try:
            path = hw.save(cached)
            where = f"cached in {path}"
        except OSError as e:
            where = f"not cached: {e}"
        if log:
            log(f"{why}: took a quick one in {time.perf_counter() - t0:.1f} s ({where}; "
                "`moelight profile` takes a fuller one)")
        return hw
    try:
        return hardware_presets.get_hardware(key)
    except KeyError as e:
        raise PlanError(f"--hardware: {e.args[0]}") from None
    except (FileNotFoundError, ValueError) as e:
        raise PlanError(f"--hardware {key}: {e}") from None


def _profile_is_stale(path) -> bool:
    """A measured CPU level (it has a GEMM curve) without the element-wise rate (written before
    the HRM charged element-wise work: plans ~25% optimistic), or a measured GPU without its
    expert-GEMM rate (written before the HRM used achieved GPU rates: plans 2-3x optimistic)."""
    import json

    try:
        d = json.loads(path.read_text())
        cpu, gpu = d.get("cpu", {}), d.get("gpu") or {}
    except (OSError, ValueError, AttributeError):
        return False  # let the normal load report what is wrong with it
    return (bool(cpu.get("gemm_flops")) and not cpu.get("elementwise_bandwidth")) or (
        bool(gpu) and not gpu.get("gemm_bandwidth"))


def resolve_device(name: str) -> str:
    """auto: the CGOPipe runtime on CUDA when there is a GPU, else the plain CPU executor."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda", "emulated"):
        raise PlanError(f"--device {name!r}: choose auto, cpu, cuda or emulated")
    if name == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: this torch build or host has no CUDA; use --device cpu or emulated")
    return name


def workload_of(prompts: list[list[int]], params: list[SamplingParams], prefill_chunk: int | None = None):
    """The HRM workload of a tokenized job: mean / max prompt length, mean generation length, and
    the engine's prefill passes (at most prefill_chunk tokens each, every one streaming the weights)."""
    from hrm import WorkloadSpec

    lens = [len(p) for p in prompts] or [1]
    gen = math.ceil(sum(q.max_tokens for q in params) / max(1, len(params))) if params else 1
    return WorkloadSpec(sum(lens) / len(lens), max(1, gen), max(lens), prefill_chunk=prefill_chunk)


def plan_job(opts: EngineOptions, cfg, dtype: str, prompts, params, device: str,
             log: Callable[[str], None] | None = None, ranks: int = 1) -> JobPlan:
    """The policy for this job: planned (auto) or read from a file, capped to the number of
    requests; explicit batch / micro-batch sizes win; then the mode (throughput or latency,
    moelight/mode_plan.py); the prediction is for what runs."""
    from hrm import model_from_hf_config
    from optimizer import InfeasibleError, Policy, fit_policy, plan, predict_job

    n_req = len(prompts)
    hw = resolve_hardware(opts.hardware, log)
    if opts.gpus is not None:
        try:
            hw = hw.with_gpus(opts.gpus)
        except ValueError as e:
            raise PlanError(f"--gpus {opts.gpus}: {e}") from None
    mspec = model_from_hf_config(cfg.to_hf_dict(), name=opts.model)
    workload = workload_of(prompts, params, opts.max_prefill_tokens)
    t0 = time.perf_counter()
    if opts.policy == "auto":
        try:
            planned = plan(hw, mspec, workload, dtype).policy
        except InfeasibleError as e:
            raise PlanError(f"the job does not fit: {e}") from None
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
    policy = fit_policy(planned, n_req)
    batch = opts.batch_size or policy.batch_size
    micro = min(opts.micro_batch_size or policy.micro_batch_size, batch)
    ran = policy.to_dict() | {"batch_size": batch, "micro_batch_size": micro,
                              "num_micro_batches": math.ceil(min(batch, n_req) / micro)}
    info = ran | {"source": source, "hardware": hw.name, "plan_seconds": plan_s,
                  "workload": workload.to_dict(), "device": device,
                  "batching": "refill" if opts.refill else "static"}
    if device != "cpu":
        info["schedule"] = opts.schedule
    if ran["batch_size"] != planned.batch_size or ran["micro_batch_size"] != planned.micro_batch_size:
        info["planned"] = planned.to_dict()
    pred = predict_job(hw, mspec, workload, policy, n_req, batch, micro)
    try:
        plan = apply_mode(JobPlan(batch, micro, policy, hw, info, pred), opts, mspec, workload, n_req, device, ranks)
    except ModeError as e:
        raise PlanError(str(e)) from None
    if log:
        p = plan.prediction
        where = ("expert cache of " f"{plan.info['cache']['slots']} slots ({plan.info['cache']['policy']})"
                 if plan.info["mode"] == "latency" else _placement(policy))
        log(f"policy ({source}, {plan_s * 1e3:.0f} ms, hardware {hw.name}): batch {plan.batch_size}, micro-batch "
            f"{plan.micro_batch_size}, {where}; predicted {p['end_to_end_tokens_per_s']:.1f} tok/s end-to-end, "
            f"bound by {p['binding']}; {plan.info['mode_reason']}")
    return plan


def _placement(policy) -> str:
    if not (policy.attn_on_gpu or policy.ffn_on_gpu):
        return "all on CPU"
    return (f"attention on {'GPU' if policy.attn_on_gpu else 'CPU'}, FFN on {'GPU' if policy.ffn_on_gpu else 'CPU'}, "
            f"r_w {policy.r_w:.3f}")


def _no_gpu_runtime(policy, asked: str) -> None:
    placed = (("attention", policy.attn_on_gpu), ("the MoE FFN", policy.ffn_on_gpu))
    where = " and ".join(name for name, on in placed if on)
    raise PlanError(
        f"the policy puts {where} on the GPU, but --device {asked} runs on the CPU; use --device cuda on a "
        "GPU host or --device emulated to run the CGOPipe runtime on an emulated accelerator, or plan for "
        "the CPU with --gpus 0 (or a CPU --hardware)"
    )
