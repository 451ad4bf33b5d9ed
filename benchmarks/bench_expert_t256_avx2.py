"""bench_expert_kernels.py's bench-1b row at T = 256 (the README job's micro-batch, ~64 rows per expert) on
the AVX2 kernels alone: bf16 / int8 / int4, best of N calls, formats alternated, the routing shifted per
call (cold weights). Quick enough to alternate builds: run it from each worktree, A B A B.

    python benchmarks/bench_expert_t256_avx2.py 5
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_kernels import dispatch  # noqa: E402
from cpu_kernels.expert_pack import bf16_matrix, pack_experts  # noqa: E402
from cpu_kernels.expert_quant import int4_group_for, quantize  # noqa: E402
from moelight.runtime.fused_experts import on_huge_pages  # noqa: E402

EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS = 8, 2, 1024, 3584, 256


def main() -> None:
    dispatch.kernel_backend()
    assert torch.ops.moelight.set_isa("avx2") == "avx2", "needs the AVX2 kernels"
    e, k, h, f, t = EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(e, 2 * f, h, generator=g) * 0.02, torch.randn(e, h, f, generator=g) * 0.02
    group = int4_group_for(h, f)
    packs = {"bf16": on_huge_pages(pack_experts(bf16_matrix(w13), bf16_matrix(w2)))}
    for fmt in ("int8", "int4"):
        packs[fmt] = on_huge_pages(pack_experts(quantize(w13, fmt, group), quantize(w2, fmt, group)))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g), -1), k, dim=-1)
    flops = 6.0 * h * f * t * k
    best = {fmt: float("inf") for fmt in packs}
    calls = 0
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
        for fmt, p in packs.items():
            shifted = (ids + calls * k) % e
            calls += 1
            t0 = time.perf_counter()
            dispatch.expert_mix(x, shifted, weights, p)
            best[fmt] = min(best[fmt], time.perf_counter() - t0)
    print(" | ".join(f"{fmt} {s * 1e3:.1f} ms {flops / s / 1e9:.0f} GFLOP/s" for fmt, s in best.items()))


if __name__ == "__main__":
    main()
