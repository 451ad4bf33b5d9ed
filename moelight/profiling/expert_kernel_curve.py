"""The CPU's routed-expert rate as the engine runs it: the fused expert kernel (cpu_kernels.expert_mix)
over one layer's experts, by tokens per expert, in bf16 and in the quantized formats. The HRM prices
the MoE FFN with it (Level.expert_peak): on hosts where oneDNN packs no bf16 weights the dense GEMM
probe measures aten's bf16 path, several times slower than this kernel, and a plan priced from it
under-predicts the job.

A job's layers each read their own experts, so a decode step streams every layer's experts from DRAM
(bench-1b: 8 x 176 MB in bf16). A probe that multiplies one layer's experts again and again reads them
from the last-level cache instead where it is large (an AMX host reported 480 MB: 64 rows per expert ran
at 835 GFLOP/s on one layer's experts, 577 on copies cycled through, what the job got in situ). So the
probe cycles through copies of the packed experts, at least STREAM_BYTES of them, as the job's layers do.
"""

from __future__ import annotations

import copy

from moelight.profiling.timing import fastest_in_rounds

EXPERT_ROWS = (1, 4, 16, 64, 256)
EXPERT_ROWS_QUICK = (1, 16, 64, 256)  # 64: a decode step of 256 sequences, top-2 of 8 experts
ROUNDS = 3  # samples of each point, a round apart (timing.fastest_in_rounds)
STREAM_BYTES = 1 << 30  # more than any last-level cache: each pass reads every copy from DRAM
_E, _K, _H, _F = 8, 2, 1024, 3584  # bench-1b's experts: a Mixtral layer at a tenth of its width


def layer_copies(packed, stream_bytes: int = STREAM_BYTES) -> list:
    """`packed` and deep copies of it: together at least `stream_bytes` (at least two layers)."""
    n = max(2, -(-stream_bytes // max(1, packed.nbytes())))
    return [packed] + [copy.deepcopy(packed) for _ in range(n - 1)]


def measure_expert_curve(quick: bool = False, stream_bytes: int = STREAM_BYTES) -> dict[str, list[list[float]]]:
    """{"bfloat16" | "int8" | "uint4" | "mxfp4": [[rows per expert, FLOP/s], ...]} of the fused kernel, the
    quantized formats as `--quantize int8|int4` holds them and MXFP4 as GPT-OSS ships it ({} where the
    kernel does not run: without the C++ kernels the engine's loop runs the experts as GEMMs, which the
    GEMM curve prices). int4 and MXFP4 experts multiply on int8 activations at every row count on AVX2
    and run faster than bf16 ones; the HRM
    prices a model's experts by its format's curve (hrm.ModelSpec.expert_format). Each rate is a pass
    over `stream_bytes` of layer copies (layer_copies), as a decode step reads its layers' experts."""
    import torch

    from cpu_kernels import expert_mix, kernel_backend, pack_experts
    from cpu_kernels.expert_pack import bf16_matrix
    from cpu_kernels.expert_quant import int4_group_for, quantize, random_mxfp4

    if kernel_backend() == "torch":
        return {}
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(_E, 2 * _F, _H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(_E, _H, _F, generator=g) * 0.02).to(torch.bfloat16)
    group = int4_group_for(_H, _F)
    makers = {"bfloat16": lambda: pack_experts(bf16_matrix(w13), bf16_matrix(w2)),
              "int8": lambda: pack_experts(quantize(w13, "int8"), quantize(w2, "int8")),
              "uint4": lambda: pack_experts(quantize(w13, "int4", group), quantize(w2, "int4", group)),
              "mxfp4": lambda: pack_experts(random_mxfp4(_E, 2 * _F, _H, g), random_mxfp4(_E, _H, _F, g))}
    rows_set = EXPERT_ROWS_QUICK if quick else EXPERT_ROWS
    inputs = []
    for rows in rows_set:
        tokens = rows * _E // _K  # token t goes to experts 2t and 2t+1 (mod E): `rows` tokens each
        ids = (torch.arange(tokens * _K) % _E).reshape(tokens, _K)
        inputs.append((rows, torch.randn(tokens, _H, generator=g).to(torch.bfloat16), ids,
                       torch.full((tokens, _K), 0.5)))
    curves: dict[str, list[list[float]]] = {}
    for name, make in makers.items():  # one format's copies at a time: at most ~stream_bytes held
        layers = layer_copies(make(), stream_bytes)

        def one_pass(x, ids, w, layers=layers) -> None:
            for p in layers:
                expert_mix(x, ids, w, p)

        passes = [lambda x=x, ids=ids, w=w: one_pass(x, ids, w) for _, x, ids, w in inputs]
        seconds = fastest_in_rounds(passes, ROUNDS)
        curves[name] = [[float(rows), 6.0 * _H * _F * rows * _E * len(layers) / t]
                        for (rows, *_), t in zip(inputs, seconds, strict=True)]
        layers = passes = None
    return curves
