"""HRM roofline plots in the style of the paper's Figs. 4 (attention) and 5 (MoE FFN).

matplotlib is imported lazily (Agg backend) so hrm itself needs only numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.roofline import ffn_intensities, turning_point_p1, turning_point_p2
from hrm.workload import WorkloadSpec


def _roofs(ax, hw: HardwareSpec, dtype: str, x: np.ndarray) -> None:
    cpu, gpu, link = hw.cpu, hw.gpu_total(), hw.link_total()
    ax.plot(x, np.full_like(x, cpu.peak_flops(dtype)), "b-", label=f"CPU compute roof ({cpu.name})")
    ax.plot(x, cpu.bandwidth * x, "b--", label="CPU memory roof")
    if gpu is not None:
        ax.plot(x, np.full_like(x, gpu.peak_flops(dtype)), "g-", label=f"GPU compute roof ({gpu.name})")
        ax.plot(x, gpu.bandwidth * x, "g--", label="GPU memory roof")
        ax.plot(x, link.h2d * x, "r--", label="CPU->GPU link roof")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("operational intensity (FLOP/byte)")
    ax.set_ylabel("performance (FLOP/s)")
    ax.grid(True, which="both", alpha=0.3)


def plot_attention(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, dtype: str, path: Path) -> Path:
    """Fig. 4: decode attention intensity (KV in dtype and int4) against the roofs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.logspace(-2, 4, 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    _roofs(ax, hw, dtype, x)
    for kv_dtype, style in ((dtype, "k:"), ("int4", "m:")):
        i = float(ops.decode_attention(m, 1, wl.mean_context, dtype_bytes(kv_dtype)).intensity)
        ax.axvline(i, color=style[0], linestyle=":", label=f"attention, KV {kv_dtype}: I={i:.2f}")
    if hw.has_gpu:
        p1 = turning_point_p1(hw.cpu.peak_flops(dtype), hw.cpu.bandwidth, hw.link_total().h2d)
        ax.axvline(p1, color="orange", label=f"P1 = {p1:.1f}")
    ax.set_title(f"HRM: {m.name} decode attention on {hw.name} ({dtype}, ctx {wl.mean_context:.0f})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_moe_ffn(hw: HardwareSpec, m: ModelSpec, dtype: str, path: Path, micro_batch: int = 128,
                 batches=(32, 128, 512, 2048, 8192), r_w: float = 0.0) -> Path:
    """Fig. 5: MoE FFN intensities (vs the data on the CPU) for several batch sizes N,
    the kernel's GPU performance at micro-batch mu, P1, P2 and the balance point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = dtype_bytes(dtype)
    x = np.logspace(-1, 5, 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    _roofs(ax, hw, dtype, x)
    for n in batches:
        _, i_cpu = ffn_intensities(m, n, min(n, micro_batch), b, r_w)
        ax.axvline(float(i_cpu), color="gray", linestyle=":", alpha=0.8)
        ax.text(float(i_cpu), hw.cpu.bandwidth * 0.2, f"N={n}", rotation=90, fontsize=7)
    if hw.has_gpu:
        gpu, link = hw.gpu_total(), hw.link_total()
        i_gpu, _ = ffn_intensities(m, micro_batch, micro_batch, b, r_w)
        perf = min(gpu.peak_flops(dtype), gpu.bandwidth * float(i_gpu))
        ax.axhline(perf, color="orange", label=f"MoE FFN kernel on GPU at mu={micro_batch}: {perf:.2e}")
        p1 = turning_point_p1(hw.cpu.peak_flops(dtype), hw.cpu.bandwidth, link.h2d)
        p2 = turning_point_p2(gpu.peak_flops(dtype), link.h2d)
        bal = perf / link.h2d
        for v, c, lab in ((p1, "purple", "P1"), (p2, "brown", "P2"), (bal, "black", "balance")):
            ax.axvline(v, color=c, linestyle="-.", label=f"{lab} = {v:.0f}")
    ax.set_title(f"HRM: {m.name} MoE FFN on {hw.name} ({dtype})")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, dtype: str, out_dir: str | Path,
             micro_batch: int = 128, r_w: float = 0.0) -> list[Path]:
    out = Path(out_dir)
    return [plot_attention(hw, m, wl, dtype, out / "hrm_attention.png"),
            plot_moe_ffn(hw, m, dtype, out / "hrm_moe_ffn.png", micro_batch=micro_batch, r_w=r_w)]
