"""Few-row bf16 matmuls (decode at batch 1-4): oneDNN's packed weight against `small_linear` on the
plain bf16 weight, the two paths PackedLinear (moelight/runtime/cpu_linear.py) chooses between.

bench-1b's non-expert shapes (the LM head, q / o and k / v projections), 1 and 4 rows, bf16. Each
weight is one of a pool larger than the L3 cache, taken in turn, so every call reads its weight
cold, as a decode step reads each layer's. Best of --repeat passes over the pool, the two paths
alternated; GB/s is the weight's bytes over the time.

    python benchmarks/bench_few_row_linear.py --output benchmarks/results/few_row_linear.md
    python benchmarks/bench_few_row_linear.py --isas avx2 auto    # small_linear's loop per ISA level
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

from markdown_report import emit  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight.runtime.cpu_linear import pack_weight, packed_linear, packing_supported  # noqa: E402

SHAPES = [("LM head", 32000, 1024), ("q / o projection", 1024, 1024), ("k / v projection", 256, 1024)]
POOL_BYTES = 256e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--output", type=Path)
    ap.add_argument("--isas", nargs="+", default=["auto"],
                    help="ISA levels to time small_linear on, each its own column (auto: the CPU's best)")
    a = ap.parse_args()
    if not (packing_supported(torch.bfloat16) and dispatch.small_linear_available()):
        sys.exit("needs oneDNN's bf16 packing and the C++ kernels (an AVX512-BF16 CPU)")
    torch.manual_seed(0)
    isas = [torch.ops.moelight.set_isa(i) for i in a.isas]  # the level each name runs at here
    torch.ops.moelight.set_isa("auto")
    lines = [f"torch {torch.__version__}, kernels {dispatch.kernel_backend()}\n",
             "| weight | rows | oneDNN packed ms | GB/s | " + " | ".join(
                 f"small_linear {i} ms | GB/s | / oneDNN" for i in isas) + " |",
             "|---|---|---|---|" + "---|---|---|" * len(isas)]
    for name, n, k in SHAPES:
        copies = max(2, int(POOL_BYTES // (n * k * 2)))
        plain = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        packed = [pack_weight(w) for w in plain]
        for m in (1, 4):
            x = torch.randn(m, k).to(torch.bfloat16)
            paths = {"onednn": lambda i, x=x, w=packed: packed_linear(x, w[i])}
            paths.update({isa: lambda i, x=x, w=plain: dispatch.small_linear(x, w[i]) for isa in isas})
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(a.repeat):
                for path, fn in paths.items():
                    torch.ops.moelight.set_isa("auto" if path == "onednn" else path)
                    t0 = time.perf_counter()
                    for i in range(copies):
                        fn(i)
                    best[path] = min(best[path], (time.perf_counter() - t0) / copies)
            gb, one = n * k * 2 / 1e9, best["onednn"]
            lines.append(f"| {name} ({n} x {k}) | {m} | {one * 1e3:.3f} | {gb / one:.1f} | " + " | ".join(
                f"{best[i] * 1e3:.3f} | {gb / best[i]:.1f} | {one / best[i]:.2f}x" for i in isas) + " |")
    torch.ops.moelight.set_isa("auto")
    emit(lines, a.output)


if __name__ == "__main__":
    main()
