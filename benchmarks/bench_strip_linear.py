"""Dense bf16 linears on a CPU whose oneDNN packs no bf16 (AVX2): the float32 copy oneDNN multiplies
(`upcast_packed_linear`) against `strip_linear` on the bf16 weight in the expert kernel's strips, and, at
up to 4 rows, `small_linear` on the plain bf16 weight: the paths PackedLinear / StripLinear
(moelight/runtime/cpu_linear.py) choose between.

The non-expert shapes of bench-1b and Qwen3-30B-A3B (LM head, q, o and k / v projections) at 1-256 rows.
Each weight is one of a pool larger than the L3 cache, taken in turn, so every call reads its weight cold,
as a decode step reads each layer's. Best of --repeat passes over the pool, the paths alternated; GFLOP/s
and the weight's GB/s (its bytes in the path's format over the time).

    python benchmarks/bench_strip_linear.py --output benchmarks/results/strip_linear_avx2.md
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
from cpu_kernels.strip_linear import pack_linear_strips, strip_linear, strip_linear_available  # noqa: E402
from moelight.runtime.cpu_linear import pack_weight, upcast_bf16_linears, upcast_packed_linear  # noqa: E402

SHAPES = [("bench-1b LM head", 32000, 1024), ("bench-1b q / o", 1024, 1024), ("bench-1b k / v", 256, 1024),
          ("Qwen3-30B-A3B LM head", 151936, 2048), ("Qwen3 q", 4096, 2048), ("Qwen3 o", 2048, 4096),
          ("Qwen3 k / v", 512, 2048)]
POOL_BYTES = 256e6


def _time(fn, count: int) -> float:
    t = time.perf_counter()
    for i in range(count):
        fn(i)
    return (time.perf_counter() - t) / count


def _shape_rows(name: str, n: int, k: int, rows: list[int], repeat: int) -> list[str]:
    """One table row per row count for weight shape [n, k]."""
    copies = max(2, int(POOL_BYTES // (n * k * 2)))
    plain = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
    strips = [pack_linear_strips(w) for w in plain]
    floats = [pack_weight(w.float()) for w in plain]
    out = []
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        paths = {"copy": lambda i, x=x: upcast_packed_linear(x, floats[i % copies]),
                 "strips": lambda i, x=x: strip_linear(x, strips[i % copies], None, n)}
        if m <= dispatch.SMALL_LINEAR_ROWS:
            paths["small"] = lambda i, x=x: dispatch.small_linear(x, plain[i % copies])
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(repeat):
            for p, fn in paths.items():
                best[p] = min(best[p], _time(fn, copies))
        flops = 2 * m * n * k
        row = [name, str(m)]
        for p, nbytes in (("copy", 4), ("strips", 2)):
            row += [f"{best[p] * 1e3:.3f}", f"{flops / best[p] / 1e9:.1f}", f"{n * k * nbytes / best[p] / 1e9:.1f}"]
        row.append(f"{best['copy'] / best['strips']:.2f}x")
        row += [f"{best['small'] * 1e3:.3f}", f"{best['copy'] / best['small']:.2f}x"] if "small" in best else ["", ""]
        out.append("| " + " | ".join(row) + " |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--shapes", nargs="+", help="names (prefixes) of SHAPES to run (default: all)")
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    if not (upcast_bf16_linears() and strip_linear_available()):
        sys.exit("needs a CPU whose oneDNN packs no bf16 (float32 copies) and the C++ kernels on AVX2 / AVX-512")
    torch.manual_seed(0)
    lines = [f"torch {torch.__version__}, kernels {dispatch.kernel_backend()}, {torch.get_num_threads()} threads\n",
             "| weight | rows | float32 copy ms | GFLOP/s | GB/s | strips ms | GFLOP/s | GB/s | strips / copy "
             "| small_linear ms | small / copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, k in SHAPES:
        if not a.shapes or any(name.startswith(s) for s in a.shapes):
            lines += _shape_rows(name, n, k, a.rows, a.repeat)
    emit(lines, a.output)


if __name__ == "__main__":
    main()
