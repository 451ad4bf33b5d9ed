"""The CPU's routed-expert rate as the engine runs it: the fused expert kernel (cpu_kernels.expert_mix)
over one layer's experts, by tokens per expert, in bf16 and in the quantized formats. The HRM prices
the MoE FFN with it (Level.expert_peak): on hosts where oneDNN packs no bf16 weights the dense GEMM
probe measures aten's bf16 path, several times slower than this kernel, and a plan priced from it
under-predicts the job."""

from __future__ import annotations

from moelight.profiling.timing import best_time

EXPERT_ROWS = (1, 4, 16, 64, 256)
EXPERT_ROWS_QUICK = (1, 16, 128)
_E, _K, _H, _F = 8, 2, 1024, 3584  # bench-1b's experts: a Mixtral layer at a tenth of its width


def measure_expert_curve(quick: bool = False) -> dict[str, list[list[float]]]:
    """{"bfloat16" | "int8" | "uint4": [[rows per expert, FLOP/s], ...]} of the fused kernel, the quantized
    formats as `--quantize int8|int4` holds them ({} where the kernel does not run: without the C++
    kernels the engine's loop runs the experts as GEMMs, which the GEMM curve prices). int4 experts
    multiply on int8 activations at every row count on AVX2 and run faster than bf16 ones; the HRM
    prices a model's experts by its format's curve (hrm.ModelSpec.expert_format)."""
    import torch

    from cpu_kernels import expert_mix, kernel_backend
    from cpu_kernels.expert_pack import bf16_matrix, pack_experts
    from cpu_kernels.expert_quant import int4_group_for, quantize

    if kernel_backend() == "torch":
        return {}
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(_E, 2 * _F, _H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(_E, _H, _F, generator=g) * 0.02).to(torch.bfloat16)
    group = int4_group_for(_H, _F)
    packs = {"bfloat16": pack_experts(bf16_matrix(w13), bf16_matrix(w2)),
             "int8": pack_experts(quantize(w13, "int8"), quantize(w2, "int8")),
             "uint4": pack_experts(quantize(w13, "int4", group), quantize(w2, "int4", group))}
    w13 = w2 = None
    curves: dict[str, list[list[float]]] = {name: [] for name in packs}
    for rows in EXPERT_ROWS_QUICK if quick else EXPERT_ROWS:
        tokens = rows * _E // _K  # token t goes to experts 2t and 2t+1 (mod E): `rows` tokens each
        ids = (torch.arange(tokens * _K) % _E).reshape(tokens, _K)
        x = torch.randn(tokens, _H, generator=g).to(torch.bfloat16)
        weights = torch.full((tokens, _K), 0.5)
        for name, packed in packs.items():
            t = best_time(lambda x=x, ids=ids, w=weights, p=packed: expert_mix(x, ids, w, p), 3)
            curves[name].append([float(rows), 6.0 * _H * _F * rows * _E / t])
    return curves
