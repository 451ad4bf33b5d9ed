"""Roofs, turning points and the balance point of the Hierarchical Roofline Model.

Notation (paper section 3.2, DESIGN.md section 3): level i computes (the GPU), level j
holds the data (the CPU). P = peak FLOP/s, B = own memory bandwidth, B_link = j->i link
bandwidth, I_i / I_j = FLOPs per byte read at level i / moved from level j.
"""

from __future__ import annotations

import numpy as np

from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.operators import OpCost, moe_ffn


def memory_roof(bandwidth: float, intensity):
    """P <= B_i * I_i (own memory) or B_{j->i} * I_j (data from another level)."""
    return bandwidth * np.asarray(intensity, dtype=float)


def attainable_local(peak: float, bandwidth: float, intensity):
    """Classic roofline, Eq. 8: data local to the processor."""
    return np.minimum(peak, bandwidth * np.asarray(intensity, dtype=float))


def attainable(peak_i: float, bw_i: float, intensity_i, bw_link: float, intensity_j):
    """Eq. 7: computed on i, data fetched from j: min(P_i, B_i*I_i, B_{j->i}*I_j)."""
    return np.minimum(attainable_local(peak_i, bw_i, intensity_i), bw_link * np.asarray(intensity_j, float))


def ridge_point(peak: float, bandwidth: float) -> float:
    """Classic turning point: intensity where the memory roof meets the compute roof."""
    return peak / bandwidth


def turning_point_p1(peak_j: float, bw_j: float, bw_link: float) -> float:
    """P1 (Eq. 9): I_j where B_link*I_j = min(P_j, B_j*I_j).

    Below it, moving the data to level i is slower than computing where the data is.
    When the link is at least as fast as j's own memory, moving always pays: P1 = 0.
    """
    if bw_link >= bw_j:
        return 0.0
    return peak_j / bw_link


def turning_point_p2(peak_i: float, bw_link: float) -> float:
    """P2 (Eq. 10): I_j where B_link*I_j = P_i; below it, work on i is link-bound."""
    return peak_i / bw_link


def balance_point(peak_i: float, bw_i: float, intensity_i, bw_link: float):
    """Eq. 11: the I_j at which the link roof meets i's own roof min(P_i, B_i*I_i).

    Raising I_j (bigger batch, more weights kept on i) helps only up to here.
    """
    return attainable_local(peak_i, bw_i, intensity_i) / bw_link


def ffn_intensities(m: ModelSpec, batch, micro_batch, b: float, r_w: float = 0.0):
    """MoE FFN intensities for one layer: (I_gpu at micro-batch mu, I_cpu of batch N).

    I_gpu: FLOPs per byte the GPU reads (touched experts, per micro-batch).
    I_cpu: FLOPs of the whole batch per byte of expert weights moved over the link,
    (1 - r_w) of the layer's experts once per batch.
    """
    mb: OpCost = moe_ffn(m, micro_batch, b)
    i_gpu = mb.intensity
    flops_batch = 6.0 * m.hidden_size * m.intermediate_size * m.top_k * np.asarray(batch, float)
    moved = max(1e-30, (1.0 - r_w)) * m.layer_expert_params() * m.expert_weight_bytes(b)
    return i_gpu, flops_batch / moved


def turning_points(hw: HardwareSpec, dtype: str) -> dict[str, float]:
    """P1, P2 and the GPU/CPU ridge points of `hw` for `dtype` (GPU = all GPUs)."""
    cpu, gpu, link = hw.cpu, hw.gpu_total(), hw.link_total()
    out = {"cpu_ridge": ridge_point(cpu.peak_flops(dtype), cpu.bandwidth)}
    if gpu is not None:
        out["gpu_ridge"] = ridge_point(gpu.peak_flops(dtype), gpu.bandwidth)
        out["P1"] = turning_point_p1(cpu.peak_flops(dtype), cpu.bandwidth, link.h2d)
        out["P2"] = turning_point_p2(gpu.peak_flops(dtype), link.h2d)
    return out
