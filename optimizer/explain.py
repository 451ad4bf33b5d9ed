"""Plain-language reasons for a plan: which roof binds, which memory limits the batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.roofline import turning_point_p1
from hrm.workload import WorkloadSpec

if TYPE_CHECKING:
    from optimizer.policy import PlanResult

GiB = 2.0**30
_NAMES = {"link": "the CPU->GPU link (paging expert weights / KV)", "gpu": "GPU compute/memory bandwidth",
          "cpu": "CPU work (attention over the KV cache)",
          "host": "host memory bandwidth (the staging copies, the links' DMA and CPU attention share it)"}


def explain(res: PlanResult, hw: HardwareSpec, model: ModelSpec, wl: WorkloadSpec) -> str:
    p, lt = res.policy, res.layer_times
    ms = {k: 1e3 * lt[k] for k in ("T_link", "T_host", "T_gpu", "T_cpu")}
    lines = [f"decode is bound by {_NAMES[res.binding]}: per layer T_link={ms['T_link']:.2f} ms, "
             f"T_host={ms['T_host']:.2f} ms, T_gpu={ms['T_gpu']:.2f} ms, T_cpu={ms['T_cpu']:.2f} ms"]
    if hw.has_gpu and hw.gpu_count > 1:
        lines.append(_tensor_parallel_line(hw, model, p))
    b = dtype_bytes(p.dtype)
    if hw.has_gpu:
        att = ops.decode_attention(model, 1, wl.mean_context, b)
        p1 = turning_point_p1(hw.cpu.peak_flops(p.dtype), hw.cpu.bandwidth, hw.link_total().h2d)
        side = "below" if float(att.intensity) < p1 else "above"
        lines.append(f"attention on {'GPU' if p.attn_on_gpu else 'CPU'}: its intensity "
                     f"{float(att.intensity):.2f} FLOP/B is {side} the turning point P1={p1:.1f} FLOP/B "
                     "(below it, moving the KV cache costs more than computing on the CPU)")
        if p.ffn_on_gpu:
            ffn = ops.moe_ffn(model, p.mu, b)
            gpu = hw.gpu_total()
            roof = "compute" if ffn.flops / gpu.peak_flops(p.dtype) > ffn.bytes / gpu.bandwidth else "memory"
            lines.append(f"MoE FFN on GPU at mu={p.mu} is {roof}-bound there "
                         f"(intensity {float(ffn.intensity):.1f} FLOP/B); r_w={p.r_w:.3f} of expert weights "
                         "stay on the GPU, the rest is paged in every layer")
    else:
        lines.append("CPU-only host: every operator runs on the CPU")
    mems = (("GPU", res.gpu_memory, res.gpu_capacity), ("CPU", res.cpu_memory, res.cpu_capacity))
    for name, used, cap in mems:
        if not used or cap <= 0:
            continue
        tot = sum(used.values())
        full = tot >= 0.99 * cap
        biggest = max(used, key=used.get)
        lines.append(f"{name} memory {tot / GiB:.2f} / {cap / GiB:.2f} GiB usable"
                     + (f" (full: it limits the plan; largest share: {biggest})" if full else ""))
    return "\n".join(lines)


def _tensor_parallel_line(hw: HardwareSpec, model: ModelSpec, p) -> str:
    from hrm import costs

    t = hw.gpu_count
    links = "one shared host link" if hw.link_shared else f"{t} host links"
    over = "PCIe (sharing the host links with the paged weights)" if hw.interconnect_over_pcie else "NVLink"
    reduce = costs.layer_allreduce_time(hw, model, p.mu, p.dtype) * p.n_mb if p.ffn_on_gpu else 0.0
    return (f"tensor parallel over {t} GPUs: {t}x GPU memory, bandwidth and FLOP/s, {links}; the layer's "
            f"two all-reduces take {reduce * 1e3:.2f} ms per layer over {over}")
