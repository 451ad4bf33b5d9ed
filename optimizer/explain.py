"""Plain-language reasons for a plan, derived from the placement it chose and the roof that binds.

Every sentence is computed from the plan itself: what runs where (A_g, F_g), which term of
T_layer is the largest, what each placement's best policy predicts (the planner searched
them all), and where the HRM's attention intensity sits against the turning point P1. When
the placement goes against the intensity rule (attention on the GPU although its intensity
is below P1), the explanation says what outweighed it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.roofline import turning_point_p1
from hrm.workload import WorkloadSpec
from optimizer.memory_limits import level_full
from optimizer.policy import share_text, size_text, time_text

if TYPE_CHECKING:
    from optimizer.policy import PlanResult


def placement_key(attn_on_gpu: bool, ffn_on_gpu: bool) -> str:
    """The name a placement goes by in PlanResult.placements."""
    return f"attention on {'GPU' if attn_on_gpu else 'CPU'}, FFN on {'GPU' if ffn_on_gpu else 'CPU'}"


def roof_name(binding: str, attn_on_gpu: bool, ffn_on_gpu: bool) -> str:
    """What the binding term of T_layer holds under this placement."""
    if binding in ("cpu", "gpu"):
        on = (binding == "gpu")
        parts = [name for name, here in (("attention over the KV cache", attn_on_gpu == on),
                                         ("the projections and the MoE FFN", ffn_on_gpu == on)) if here]
        return f"{binding.upper()} work ({' and '.join(parts) or 'none'})"
    if binding == "link":
        parts = (["paging expert weights"] if ffn_on_gpu else []) + (["moving the KV cache"] if attn_on_gpu else [])
        if attn_on_gpu != ffn_on_gpu:
            parts.append("activations between attention and the FFN")
        return f"the CPU->GPU link ({' and '.join(parts) or 'nothing to move'})"
    return {
        "host": "host memory bandwidth (the staging copies, the links' DMA and CPU attention share it)",
        "stage": "the copy of paged weights into pinned buffers (the first paging hop)",
    }[binding]


def explain(res: PlanResult, hw: HardwareSpec, model: ModelSpec, wl: WorkloadSpec) -> str:
    p, lt = res.policy, res.layer_times
    secs = {k: lt.get(k, 0.0) for k in ("T_link", "T_host", "T_stage", "T_gpu", "T_cpu")}
    lines = [f"decode is bound by {roof_name(res.binding, p.attn_on_gpu, p.ffn_on_gpu)}: per layer "
             + ", ".join(f"{k}={time_text(v)}" for k, v in secs.items() if k != "T_stage" or v > 0)]
    if hw.has_gpu and hw.gpu_count > 1:
        lines.append(_tensor_parallel_line(hw, model, p))
    if hw.has_gpu:
        lines.append(_attention_line(res, hw, model, wl))
        lines.append(_ffn_line(res, hw, model))
    else:
        lines.append("CPU-only host: every operator runs on the CPU")
    mems = (("GPU", res.gpu_memory, res.gpu_capacity), ("CPU", res.cpu_memory, res.cpu_capacity))
    for name, used, cap in mems:
        if not used or cap <= 0:
            continue
        lines.append(f"{name} memory {size_text(sum(used.values()))} / {size_text(cap)} usable"
                     + _full_note(res, name, used, cap))
    if res.mu_cap and p.mu >= res.mu_cap:
        lines.append(f"mu={p.mu} is the top of the planner's micro-batch grid (at most {res.mu_cap} sequences; "
                     "README: policy search): the grid's cap, not memory, stops larger micro-batches")
    return "\n".join(lines)


def _full_note(res: PlanResult, name: str, used: dict[str, float], cap: float) -> str:
    """Whether a full level is what limits the plan, as the planner checked (more of it predicts faster)."""
    if not level_full(used, cap):
        return ""
    biggest = max(used, key=used.get)
    if res.memory_limits is None:  # a given policy: nothing was searched
        return f" (full; largest share: {biggest})"
    if name in res.memory_limits:
        return f" (full: it limits the plan, more would predict faster; largest share: {biggest})"
    return (f" (full, but it does not limit the plan: twice as much predicts no faster; largest share: {biggest}"
            + ("; resident experts take what the rest leaves" if name == "GPU" and res.policy.ffn_on_gpu else "")
            + ")")


def _versus(res: PlanResult, attn_on_gpu: bool, ffn_on_gpu: bool) -> str:
    """'X tok/s against Y with <alternative>' from the planner's per-placement bests."""
    here = res.e2e_tok_s
    alt_key = placement_key(attn_on_gpu, ffn_on_gpu)
    if alt_key not in res.placements:
        return "the other side was not searched (policy family)"
    alt = res.placements[alt_key]
    if alt is None:
        return f"no policy with {alt_key} fits in memory"
    return f"{here:.1f} tok/s predicted against {alt:.1f} for the best policy with {alt_key}"


def _attention_line(res: PlanResult, hw: HardwareSpec, model: ModelSpec, wl: WorkloadSpec) -> str:
    p = res.policy
    b = dtype_bytes(p.dtype)
    att = ops.decode_attention(model, 1, wl.mean_context, b)
    i_att = float(att.intensity)
    p1 = turning_point_p1(hw.cpu.peak_flops(p.dtype), hw.cpu.bandwidth, hw.link_total().h2d)
    below = i_att < p1
    side = "GPU" if p.attn_on_gpu else "CPU"
    line = (f"attention on {side}: {_versus(res, not p.attn_on_gpu, p.ffn_on_gpu)}; its intensity "
            f"{i_att:.2f} FLOP/B is {'below' if below else 'above'} the turning point P1={p1:.1f} FLOP/B")
    if p.attn_on_gpu and below:
        if p.r_c >= 0.005:  # a share the plan prints as 0% is not a reason
            why = f"{p.r_c:.0%} of the KV cache stays on the GPU, where no link crossing is paid"
        elif not p.ffn_on_gpu and res.layer_times.get("T_cpu", 0.0) >= res.layer_times.get("T_link", 0.0):
            why = ("the CPU already carries the FFN and binds; moving attention off it shortens T_cpu more "
                   "than its KV adds to the link")
        else:
            why = "the whole policy with it there predicts faster, although on its own it would read cheaper on the CPU"
        return line + f" (the rule says CPU; GPU wins here because {why})"
    if not p.attn_on_gpu and not below:
        return line + " (the rule says GPU; CPU wins here because moving the KV cache would load the binding link)"
    return line + (" (reading the KV cache where it lies beats moving it)" if not p.attn_on_gpu
                   else " (moving the KV cache to the GPU pays)")


def _ffn_line(res: PlanResult, hw: HardwareSpec, model: ModelSpec) -> str:
    p = res.policy
    side = "GPU" if p.ffn_on_gpu else "CPU"
    line = f"MoE FFN on {side}: {_versus(res, p.attn_on_gpu, not p.ffn_on_gpu)}"
    if not p.ffn_on_gpu:
        return line + "; every expert is read from host memory where it lies, nothing is paged"
    b = dtype_bytes(p.dtype)
    ffn = ops.moe_ffn(model, p.mu, b)
    gpu = hw.gpu_total()
    t_flops = float(ffn.flops) / gpu.gemm_peak(p.dtype, ffn.rows)
    t_bytes = float(ffn.bytes) / gpu.weight_stream_bandwidth()
    roof = "compute" if t_flops > t_bytes else "memory"
    if p.r_w >= 1.0:
        held = "r_w=1: every expert stays resident on the GPU, nothing is paged"
    elif p.r_w <= 0.0:
        held = "r_w=0: every expert is paged in every layer"
    else:
        held = f"r_w={share_text(p.r_w)} of expert weights stay on the GPU, the rest is paged in every layer"
    return line + f"; at mu={p.mu} ({float(ffn.rows):.1f} tokens per expert) it is {roof}-bound there; {held}"


def _tensor_parallel_line(hw: HardwareSpec, model: ModelSpec, p) -> str:
    from hrm import costs

    t = hw.gpu_count
    links = "one shared host link" if hw.link_shared else f"{t} host links"
    over = "PCIe (sharing the host links with the paged weights)" if hw.interconnect_over_pcie else "NVLink"
    reduce = costs.layer_allreduce_time(hw, model, p.mu, p.dtype) * p.n_mb if p.ffn_on_gpu else 0.0
    return (f"tensor parallel over {t} GPUs: {t}x GPU memory, bandwidth and FLOP/s, {links}; the layer's "
            f"two all-reduces take {reduce * 1e3:.2f} ms per layer over {over}")
