"""MXFP4 experts (GPT-OSS's, kept packed) on the fused expert kernel: int8 activations against the
codes dequantised on the float path, beside bf16 and int4 experts of the same shape.

GPT-OSS ships its experts as e2m1 codes with a power-of-two scale per 32 k. Twice an e2m1 value is an
integer in [-12, 12], so the AVX2 kernel can multiply the codes in 8-bit multiply-adds on activations
rounded to int8 per block of 32 k, as it does int4 codes (csrc/expert_iq4_tiles_avx2.h). Variants, one
MoE layer call each, alternated in one process (a change of host state hits all of them), best of
--repeat, each call routed to other experts than the one before (cold weights, as a decode step's
layers read them; bench_expert_kernels._best):
- `mxfp4 int8-act`: the kernel as it ships (MXFP4 on int8 activations where the ISA has that path),
- `mxfp4 float`: int8 activations off, the codes expanded to bf16 values for the float GEMM (the path
  MXFP4 took before, and the one MOELIGHT_INT8_ACTIVATIONS=0 keeps),
- `int4` (group from int4_group_for, int8 activations) and `bf16`: the same shape in the other formats.
At one token a call reads 4 of 32 experts: its weight bytes over the time, against a streaming read
of the same minute, is the bandwidth share.

    python benchmarks/bench_mxfp4_experts.py --output benchmarks/results/expert_mxfp4_avx2.md
    python benchmarks/bench_mxfp4_experts.py --shapes bench-gpt-oss --tokens 1 8 --repeat 3

~4 minutes on two cores (gpt-oss-20b's shape: 1.6 GB of bf16 experts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_expert_kernels import _best, _read_bandwidth  # noqa: E402
from markdown_report import commit, emit  # noqa: E402

from cpu_kernels import dispatch, kernel_backend  # noqa: E402
from cpu_kernels.expert_pack import bf16_matrix, pack_experts  # noqa: E402
from cpu_kernels.expert_quant import int4_group_for, quantize, random_mxfp4  # noqa: E402
from moelight.runtime.fused_experts import on_huge_pages  # noqa: E402

# name, experts, top-k, hidden, expert width
SHAPES = [("gpt-oss-20b", 32, 4, 2880, 2880), ("bench-gpt-oss", 32, 4, 1024, 896)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256], help="rows per layer call (T)")
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    unknown = sorted(set(a.shapes) - {s[0] for s in SHAPES})
    if unknown or min(a.tokens) < 1:
        sys.exit(f"--shapes {' '.join(unknown)}: not one of {', '.join(s[0] for s in SHAPES)}" if unknown
                 else "--tokens: each a positive number of rows per layer call")
    dispatch.kernel_backend()
    if kernel_backend() == "torch":
        sys.exit("needs the C++ kernels")
    isa, int8_activations = torch.ops.moelight.kernel_isa(), dispatch.INT8_ACTIVATIONS
    lines = [f"Commit {commit()}, torch {torch.__version__}, ISA {isa}; ms per MoE layer call (best of "
             f"{a.repeat}, variants alternated), weight GB/s at the experts the call touched, the streaming "
             "read of the same T's round beside it.\n",
             "| shape | T | variant | ms | GB/s of weights | read GB/s | share of read | over mxfp4 float |",
             "|---|---|---|---|---|---|---|---|"]
    try:
        for name, e, k, h, f in SHAPES:
            if name not in a.shapes:
                continue
            g = torch.Generator().manual_seed(0)
            w13, w2 = torch.randn(e, 2 * f, h, generator=g) * 0.02, torch.randn(e, h, f, generator=g) * 0.02
            group = int4_group_for(h, f)
            mx = on_huge_pages(pack_experts(random_mxfp4(e, 2 * f, h, g), random_mxfp4(e, h, f, g)))
            packs = {"mxfp4 int8-act": (mx, True), "mxfp4 float": (mx, False),
                     "int4": (on_huge_pages(pack_experts(quantize(w13, "int4", group), quantize(w2, "int4", group))),
                              True),
                     "bf16": (on_huge_pages(pack_experts(bf16_matrix(w13), bf16_matrix(w2))), True)}
            del w13, w2
            for t in a.tokens:
                x = torch.randn(t, h, generator=g).to(torch.bfloat16)
                weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g), -1), k, dim=-1)
                touched = len(torch.unique(ids))

                def call(i, p, int8_act, x=x, w=weights):
                    dispatch.INT8_ACTIVATIONS = int8_act
                    dispatch.expert_mix(x, i, w, p)

                fns = {v: (lambda i, p=p, q=q: call(i, p, q)) for v, (p, q) in packs.items()}
                bw = _read_bandwidth()
                times = _best(fns, a.repeat, ids, e)
                base = times["mxfp4 float"]
                for v, s in times.items():
                    weight_bytes = packs[v][0].nbytes() * touched / e
                    lines.append(f"| {name} | {t} | {v} | {s * 1e3:.2f} | {weight_bytes / s / 1e9:.1f} | "
                                 f"{bw / 1e9:.1f} | {100 * weight_bytes / s / bw:.0f}% | {base / s:.2f}x |")
                    print(lines[-1], flush=True)
    finally:
        dispatch.INT8_ACTIVATIONS = int8_activations
    emit(lines, a.output)


if __name__ == "__main__":
    main()
