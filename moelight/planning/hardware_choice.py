"""What a job is planned for: the hardware spec (a preset, a profile JSON, this machine's cached
profile) and the device the engine runs on."""

from __future__ import annotations

import time
from collections.abc import Callable

from moelight.errors import MoelightError
from moelight.profiling.host_load import busy_warning


class PlanError(MoelightError):
    """The policy cannot run: it does not fit, it cannot be read, or it needs a missing GPU."""


EMULATED_GPU = "t4"  # what --device emulated emulates when neither --hardware nor this machine names a GPU


def hardware_for_device(name: str | None, device: str, log: Callable[[str], None] | None = None,
                        host_available: int | None = None, host_in_use: int = 0):
    """resolve_hardware, except that `--device emulated` without `--hardware` on a host with no GPU
    emulates a named GPU preset (and says which) instead of planning for a machine without one.
    `host_available`: the host memory this job can have now (MemAvailable + the model this process holds);
    planning for this machine (`profile`), the CPU's memory is that, not the RAM installed, so the plan is
    one the memory check before loading (planning/memory_check.py, which reads the same figure) accepts.
    `host_in_use`: what the job's process needs beside the model (torch, the tokenizer, the engine's
    runtime), which the HRM's terms leave out: it comes off the host memory a file or preset declares
    (MemAvailable already excludes it, so `host_available` is not cut again)."""
    hw = resolve_hardware(name, log)
    this_machine = (name or "profile").lower() == "profile"
    if device == "emulated" and name is None and not hw.has_gpu:
        from hrm import hardware_presets

        hw, this_machine = hardware_presets.get_hardware(EMULATED_GPU), False
        if log:
            log(f"--device emulated without --hardware on a host with no GPU: emulating the {EMULATED_GPU} preset "
                f"({hw.gpu.name}); pass --hardware PRESET to emulate another")
    if host_in_use > 0:
        hw = _less_process_memory(hw, host_in_use, log)
    if host_available is not None and this_machine:
        hw = with_host_memory(hw, host_available)
    return hw


def _less_process_memory(hw, held: int, log: Callable[[str], None] | None):
    """`hw` with `held` bytes (this process beside the model) off its host memory; PlanError when nothing is left."""
    from optimizer.policy import size_text

    declared = hw.cpu.memory_bytes
    if held >= declared:
        raise PlanError(
            f"hardware {hw.name} declares {size_text(declared)} of host memory, but this process needs "
            f"{size_text(held)} of it beside the model (torch, the tokenizer, the engine's runtime): no job fits; "
            "declare the host's real memory in the hardware file, or plan for this machine (--hardware profile)")
    if log and held > declared / 10:
        log(f"host memory: {size_text(held)} of the {size_text(declared)} hardware {hw.name} declares is this "
            f"process's beside the model (torch, the tokenizer, the engine's runtime): planning with the other "
            f"{size_text(declared - held)}")
    return with_host_memory(hw, declared - held)


def with_host_memory(hw, available: int):
    """`hw` with its CPU memory cut to `available` bytes (never raised above what the profile measured)."""
    from dataclasses import replace

    return replace(hw, cpu=replace(hw.cpu, memory_bytes=min(hw.cpu.memory_bytes, available)))


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

        why = "an older moelight's or a damaged profile" if cached.is_file() else "no hardware profile yet"
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
    else:
        try:
            hw = hardware_presets.get_hardware(key)
        except KeyError as e:
            raise PlanError(f"--hardware: {e.args[0]}") from None
        except (FileNotFoundError, ValueError) as e:
            raise PlanError(f"--hardware {key}: {e}") from None
    warning = busy_warning(hw.notes)  # a profile taken beside other work prices this plan
    if log and warning:
        log(warning)
    return hw


def _profile_is_stale(path) -> bool:
    """Not JSON (a write cut short), or a measured CPU level (it has a GEMM curve) without the element-wise
    rate (written before the HRM charged element-wise work: plans ~25% optimistic) or without the host's work per
    sequence (large batches on a GPU host: several times optimistic) or without the rate of its passes over
    the logits (written before the layer glue and the expert probes were measured in place: the README job
    on an AMX host ~40% optimistic) or without the KV pool's first-touch rate and the time it was measured
    (written before prefill paid a fresh pool's page faults, and before a job's report could print the
    profile's age), or a measured GPU without its
    expert-GEMM rate (written before the HRM used achieved GPU rates: plans 2-3x optimistic) or
    without the runtime's cost per layer pass (small models on fast GPUs: ~10x optimistic), or a CPU
    GEMM curve measured on another form of the bf16 matmul weights than this engine holds them in
    (_gemm_form_changed), or expert-kernel curves without MXFP4's (written before MXFP4 experts multiplied on
    int8 activations: GPT-OSS's experts were priced at bf16's rate, its plans pessimistic)."""
    import json

    try:
        d = json.loads(path.read_text())
        cpu, gpu = d.get("cpu", {}), d.get("gpu") or {}
    except ValueError:
        return True  # cut short (a run killed, or a disk full, while it was written): take it again
    except (OSError, AttributeError):
        return False  # let the normal load report what is wrong with it
    measured_cpu = bool(cpu.get("gemm_flops"))
    return (measured_cpu and (not cpu.get("elementwise_bandwidth") or not cpu.get("sequence_step_s")
                              or not cpu.get("logits_bandwidth") or not cpu.get("kv_first_touch_bandwidth")
                              or not d.get("measured_at") or _gemm_form_changed(cpu)
                              or _expert_curves_lack_mxfp4(cpu))) or (
        bool(gpu) and (not gpu.get("gemm_bandwidth") or not gpu.get("runtime_layer_s")))


def _expert_curves_lack_mxfp4(cpu: dict) -> bool:
    """The profile measured the expert kernel's formats (uint4 among them) but not MXFP4."""
    curves = cpu.get("expert_gemm_flops") or {}
    return "uint4" in curves and "mxfp4" not in curves


def _gemm_form_changed(cpu: dict) -> bool:
    """The CPU's bf16 GEMM curve was measured on another form of the weights than the engine here holds
    them in (runtime/cpu_linear's linear_form): a profile copied from another host, or one written before
    the form was recorded on a host that now runs the bf16 strips (those measured float32 copies, 1.0-3.3x
    slower at 1-64 rows, so their few-row plans were pessimistic). Unrecorded forms elsewhere were the
    same as today's."""
    from moelight.profiling.machine_profile import bf16_gemm_form

    current = bf16_gemm_form()
    recorded = cpu.get("gemm_form")
    return current == "strips" if recorded is None else recorded != current


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


def cuda_dtype_advice(requested: str, resolved: str, capability: tuple[int, int]) -> tuple[str | None, str]:
    """(the dtype to run instead, or None; a note for the log) for a GPU of this compute capability.

    GPUs before Ampere (sm_80: T4, V100) have no bfloat16 arithmetic: `--dtype auto` runs float16
    there, whose range (65504) some families' activations exceed (a NumericalError then says so);
    an explicit `--dtype bfloat16` is kept, and runs emulated, slowly."""
    if capability >= (8, 0) or resolved != "bfloat16":
        return None, ""
    sm = f"sm_{capability[0]}{capability[1]}"
    if requested == "auto":
        return "float16", (f"this GPU ({sm}) has no bfloat16 arithmetic: running float16 (a family whose "
                           "activations exceed float16's range stops with an error; --dtype float32 avoids it)")
    return None, f"--dtype bfloat16 on this GPU ({sm}) runs without hardware support, slowly; --dtype float16 is native"
