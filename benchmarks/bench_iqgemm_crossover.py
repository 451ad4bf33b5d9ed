"""Where an int8 / int4 expert's rows stop being cheaper on int8 activations (iqgemm) than on its
codes dequantised to bf16 for the GEMM: the crossover ExpertIsa::iqgemm_rows_i8 / iqgemm_rows_u4 sets.

For each family's expert shape (as bench_expert_kernels.py) and a number of rows per expert, every
expert gets exactly that many rows (T = rows x experts / top-k tokens, all experts touched) and one
MoE layer call is timed with
- `vnni`: the AVX512-BF16 kernels, whose iqgemm (AVX512-VNNI's products) takes every row count,
- `deq`: the active ISA with int8 activations off (dequantise each strip once, then the ISA's GEMM:
  AMX-BF16 tiles on an AMX host),
- `auto`: the active ISA as it ships (iqgemm up to its crossover, the GEMM above),
alternated in a rotating order (no variant always runs after the same one), best of --repeat.

    python benchmarks/bench_iqgemm_crossover.py --output benchmarks/results/expert_iqgemm_amx.md
    python benchmarks/bench_iqgemm_crossover.py --shapes bench-qwen3-moe --rows 8 12 16

~3 minutes a shape on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_expert_kernels import SHAPES  # noqa: E402
from markdown_report import commit, emit  # noqa: E402

from cpu_kernels import dispatch, kernel_backend  # noqa: E402
from cpu_kernels.expert_pack import pack_experts  # noqa: E402
from cpu_kernels.expert_quant import int4_group_for, quantize  # noqa: E402

VARIANTS = ("vnni", "deq", "auto")
FORMATS = ("int8", "int4")
ROWS = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 24, 32, 48, 64)


def _run(variant: str, active: str, x, ids, weights, packed) -> float:
    torch.ops.moelight.set_isa("avx512bf16" if variant == "vnni" else active)
    dispatch.INT8_ACTIVATIONS = variant != "deq"
    t0 = time.perf_counter()
    dispatch.expert_mix(x, ids, weights, packed)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="rows per expert")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="shape names, or a prefix of one")
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    dispatch.kernel_backend()
    if kernel_backend() == "torch" or torch.ops.moelight.set_isa("avx512bf16") != "avx512bf16":
        sys.exit("needs the C++ kernels on a CPU with AVX512-BF16 (and VNNI)")
    torch.ops.moelight.set_isa("auto")
    active, int8_activations = torch.ops.moelight.kernel_isa(), dispatch.INT8_ACTIVATIONS
    lines = [f"Commit {commit()}, torch {torch.__version__}, active ISA {active}; ms per MoE layer call, best of "
             f"{a.repeat}; every expert has exactly `rows` rows. vnni: iqgemm at every row count (AVX512-BF16's "
             f"table); deq: int8 activations off ({active}'s dequantise + GEMM); auto: {active} as it ships.\n",
             "| shape | rows per expert | T | " + " | ".join(f"{fmt} {v}" for fmt in FORMATS for v in VARIANTS) + " |",
             "|---|---|---|" + "---|" * 2 * len(VARIANTS)]
    try:
        for name, e, k, h, f in SHAPES:
            if not any(name.startswith(s) for s in a.shapes):
                continue
            g = torch.Generator().manual_seed(0)
            w13, w2 = torch.randn(e, 2 * f, h, generator=g) * 0.02, torch.randn(e, h, f, generator=g) * 0.02
            group = int4_group_for(h, f)
            packs = {fmt: pack_experts(quantize(w13, fmt, group), quantize(w2, fmt, group)) for fmt in FORMATS}
            for rows in a.rows:
                t = rows * e // k
                ids = torch.arange(t * k).view(t, k) % e  # token i's slots on consecutive experts: `rows` each
                x = torch.randn(t, h, generator=g).to(torch.bfloat16)
                weights = torch.rand(t, k, generator=g)
                runs = [(fmt, v) for fmt in packs for v in VARIANTS]
                best = dict.fromkeys(runs, float("inf"))
                for i in range(a.repeat):
                    for fmt, v in runs[i % len(runs):] + runs[:i % len(runs)]:
                        best[fmt, v] = min(best[fmt, v], _run(v, active, x, ids, weights, packs[fmt]))
                lines.append(f"| {name} | {rows} | {t} | " + " | ".join(f"{best[r] * 1e3:.2f}" for r in runs) + " |")
                print(lines[-1], flush=True)
    finally:
        torch.ops.moelight.set_isa("auto")
        dispatch.INT8_ACTIVATIONS = int8_activations
    emit(lines, a.output)


if __name__ == "__main__":
    main()
