"""A cached profile as today's `moelight profile` writes it: every rate and field the staleness rule
(planning/hardware_choice._profile_is_stale) asks for, so a test can drop one and see the profile retaken,
and a new rule needs one edit here, not one per test."""

from __future__ import annotations

from pathlib import Path

from hrm import HardwareSpec, Level
from moelight.profiling.machine_profile import bf16_gemm_form

MEASURED_AT = "2026-11-30T00:00:00+00:00"


def measured_cpu(**kw) -> Level:
    """A measured CPU level (it has a GEMM curve) with every rate the HRM uses; `kw` overrides fields."""
    base = dict(name="c", memory_bytes=1e10, bandwidth=1e10, flops={"bfloat16": 1e11},
                gemm_flops={"bfloat16": [[1, 1e9]]}, elementwise_bandwidth=2e10, sequence_step_s=4e-5,
                logits_bandwidth=1e10, kv_first_touch_bandwidth=2e9, gemm_form=bf16_gemm_form())
    return Level(**(base | kw))


def current_profile(cpu: Level | None = None, **spec) -> HardwareSpec:
    """A profile written now: `cpu` (measured_cpu()), its time, and `spec`'s fields (a GPU, its link)."""
    return HardwareSpec("profiled", cpu or measured_cpu(), measured_at=MEASURED_AT, **spec)


def save_current_profile(path: Path, cpu: Level | None = None, **spec) -> Path:
    return current_profile(cpu, **spec).save(path)
