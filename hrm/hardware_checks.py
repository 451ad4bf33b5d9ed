"""What a hand-written hardware JSON must hold before the HRM divides by it.

A profile or a preset copied and edited by hand is read field by field: a missing required field, a
dtype key the planner never looks up ('fp16' where it asks for 'float16'), or a rate so small that
a layer's time overflows would otherwise surface later as a KeyError traceback, a Python-internal
message or a 0 tok/s plan. Every problem is collected and named by its field path.
"""

from __future__ import annotations

import math

from hrm.dtypes import DTYPE_BYTES

# the slowest rate (bytes/s or FLOP/s) a spec may give: 1 MB/s, far below any real link, memory or core;
# below it a layer's time overflows float64 arithmetic and every plan predicts 0 tok/s
RATE_FLOOR = 1e6
# the keys of a dtype -> rate map: the dtypes the planner looks rates up by
DTYPE_KEYS = tuple(DTYPE_BYTES)
# expert_gemm_flops also takes the quantized expert formats whose kernel `moelight profile` measures
EXPERT_KEYS = (*DTYPE_KEYS, "uint4", "fp8", "mxfp4")
# the forms a CPU level's bf16 GEMM curve may have been measured on (moelight's runtime/cpu_linear.linear_form);
# '' where a profile did not record it
GEMM_FORMS = ("", "packed", "strips", "float32", "dense")
REQUIRED = {"cpu": ("name", "memory_bytes", "bandwidth"), "gpu": ("name", "memory_bytes", "bandwidth"),
            "link": ("h2d", "d2h")}


def missing_fields(d: dict) -> list[str]:
    """The required fields `d` (a hardware JSON object) lacks, as paths (cpu.bandwidth), or parts that are
    not JSON objects."""
    out = [] if "cpu" in d else ["cpu (the host's level: name, memory_bytes, bandwidth, flops)"]
    if d.get("gpu") and d.get("gpu_count", 1) and not d.get("link"):
        out.append("link (h2d, d2h bytes/s: a gpu needs it)")
    for part, names in REQUIRED.items():
        v = d.get(part)
        if v is None:
            continue
        if not isinstance(v, dict):
            out.append(f"{part} must be a JSON object, got {v!r}")
            continue
        out += [f"{part}.{n}" for n in names if n not in v]
    return out


def number(bad: list[str], where: str, v, zero_ok: bool = True, rate: bool = False) -> None:
    """Append to `bad` if `v` is not a finite non-negative number (positive unless zero_ok; a rate at
    least RATE_FLOOR unless 0)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
    if not ok or (v == 0 and not zero_ok):
        bad.append(f"{where} must be a {'non-negative' if zero_ok else 'positive'} number, got {v!r}")
    elif rate and 0 < v < RATE_FLOOR:
        bad.append(f"{where} is {v!r}, below the floor of {RATE_FLOOR:.0e} per second a rate may be "
                   f"({'0 for not measured, or ' if zero_ok else ''}a rate in bytes/s or FLOP/s)")


def dtype_keys(bad: list[str], where: str, rates: dict, allowed: tuple[str, ...]) -> None:
    """Append to `bad` every key of `rates` the planner would never look up."""
    from hrm.dtypes import canonical_dtype

    for key in rates:
        if key in allowed:
            continue
        try:
            meant = canonical_dtype(str(key))
        except ValueError:
            meant = ""
        hint = f" (did you mean {meant!r}?)" if meant in allowed else ""
        bad.append(f"{where} has the unknown key {key!r}{hint}; the keys are {', '.join(allowed)}")


def check_curves(where: str, curves, bad: list[str], allowed: tuple[str, ...] = DTYPE_KEYS) -> None:
    """Append to `bad` what is wrong with a {dtype: [[M, FLOP/s], ...]} map (a curve read as rates)."""
    if not isinstance(curves, dict):
        bad.append(f"{where} must map dtypes to [[M, FLOP/s], ...] curves, got {curves!r}")
        return
    dtype_keys(bad, where, curves, allowed)
    for dtype, curve in curves.items():
        pairs = curve if isinstance(curve, list) and curve else [None]
        ok = all(isinstance(p, list) and len(p) == 2
                 and all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in p)
                 and p[0] >= 1 and p[1] >= RATE_FLOOR for p in pairs)
        if ok and any(a[0] >= b[0] for a, b in zip(pairs[:-1], pairs[1:], strict=True)):
            ok = False
        if not ok:
            bad.append(f"{where}.{dtype} must be a list of [M, FLOP/s] pairs, M >= 1 ascending and FLOP/s "
                       f"at least {RATE_FLOOR:.0e}, got {curve!r}")


def check_level(bad: list[str], name: str, lvl) -> None:
    """Append to `bad` what is wrong with one level (cpu or gpu)."""
    number(bad, f"{name}.memory_bytes", lvl.memory_bytes, zero_ok=False)
    number(bad, f"{name}.bandwidth", lvl.bandwidth, zero_ok=False, rate=True)
    if not isinstance(lvl.flops, dict) or not lvl.flops:
        bad.append(f"{name}.flops must map dtypes to FLOP/s (float32, bfloat16, ...), got {lvl.flops!r}")
    else:
        dtype_keys(bad, f"{name}.flops", lvl.flops, DTYPE_KEYS)
        for dtype, v in lvl.flops.items():
            number(bad, f"{name}.flops.{dtype}", v, zero_ok=False, rate=True)
    check_curves(f"{name}.gemm_flops", lvl.gemm_flops, bad)
    if lvl.gemm_form not in GEMM_FORMS:
        bad.append(f"{name}.gemm_form must be one of {', '.join(map(repr, GEMM_FORMS))} (the form of the bf16 "
                   f"weights its GEMM curve measured), got {lvl.gemm_form!r}")
    check_curves(f"{name}.expert_gemm_flops", lvl.expert_gemm_flops, bad, EXPERT_KEYS)
    attn = lvl.attention_flops
    if not isinstance(attn, dict):
        bad.append(f"{name}.attention_flops must map dtypes to FLOP/s, got {attn!r}")
    else:
        dtype_keys(bad, f"{name}.attention_flops", attn, DTYPE_KEYS)
        for dtype, v in attn.items():
            number(bad, f"{name}.attention_flops.{dtype}", v, rate=True)
    for f in ("attention_bandwidth", "elementwise_bandwidth", "gemm_bandwidth", "logits_bandwidth",
              "kv_first_touch_bandwidth"):
        number(bad, f"{name}.{f}", getattr(lvl, f), rate=True)
    if not isinstance(lvl.fused_dequant, bool):
        bad.append(f"{name}.fused_dequant must be true or false, got {lvl.fused_dequant!r}")
    for f in ("layer_overhead_s", "runtime_layer_s", "step_overhead_s", "sequence_step_s"):
        number(bad, f"{name}.{f}", getattr(lvl, f))


def spec_problems(hw) -> list[str]:
    """Every field of a HardwareSpec the model cannot divide by, named by its path."""
    bad: list[str] = []
    for name, lvl in (("cpu", hw.cpu), ("gpu", hw.gpu)):
        if lvl is not None:
            check_level(bad, name, lvl)
    if hw.gpu is not None:
        if isinstance(hw.gpu_count, bool) or not isinstance(hw.gpu_count, int) or hw.gpu_count < 1:
            bad.append(f"gpu_count must be a whole number >= 1 with a gpu, got {hw.gpu_count!r}")
        if hw.link is None:
            bad.append("a gpu needs its link (h2d, d2h bytes/s)")
    if not isinstance(hw.link_shared, bool):
        bad.append(f"link_shared must be true or false, got {hw.link_shared!r}")
    if hw.link is not None:
        number(bad, "link.h2d", hw.link.h2d, zero_ok=False, rate=True)
        number(bad, "link.d2h", hw.link.d2h, zero_ok=False, rate=True)
        for f in ("pageable_h2d", "pageable_d2h"):
            number(bad, f"link.{f}", getattr(hw.link, f), rate=True)
        number(bad, "link.latency_s", hw.link.latency_s)
    for f in ("interconnect", "host_bandwidth", "staging_bandwidth"):
        number(bad, f, getattr(hw, f), rate=True)
    number(bad, "interconnect_latency_s", hw.interconnect_latency_s)
    if not isinstance(hw.measured_at, str):
        bad.append(f"measured_at must be a date and time (ISO 8601) or empty, got {hw.measured_at!r}")
    return bad


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def dtype_rate_problem(hw, dtype: str) -> str | None:
    """What a plan in `dtype` on `hw` would look up and not find: a level (the CPU, and the GPUs where the
    plan may use them) whose flops hold neither `dtype` nor float32, the rate every dtype falls back on.
    Checked before planning, so it is one message naming the level and the keys, not a KeyError in the HRM."""
    from hrm.dtypes import canonical_dtype

    key = canonical_dtype(dtype)
    levels = [("cpu", hw.cpu)] + ([("gpu", hw.gpu)] if hw.has_gpu else [])
    short = [(name, lvl) for name, lvl in levels if key not in lvl.flops and "float32" not in lvl.flops]
    if not short:
        return None
    held = "; ".join(f"{name}.flops holds {', '.join(lvl.flops) or 'nothing'}" for name, lvl in short)
    where = " and ".join(f"{name}.flops" for name, _ in short)
    usable = [d for d in COMPUTE_DTYPES if all(d in lvl.flops or "float32" in lvl.flops for _, lvl in levels)]
    alt = f", or plan in {' or '.join(usable)} (--dtype {usable[0]})" if usable else ""
    need = "float32" if key == "float32" else f"{key} or float32 (the rate any dtype falls back on)"
    return (f"hardware spec {hw.name!r}: a {key} plan needs {where} to hold {need}, and {held}: add "
            f"\"{key}\": FLOP/s to {where}{alt}")
