"""A batch-1 decode step's streamed weights on 4 KiB pages against the same weights on 2 MiB huge pages.

The CPU engine now copies the packed experts and the plain bf16 weights small_linear reads onto huge
pages (moelight.runtime.host_memory.huge_copy); this measures what that buys, in one process because
the host's bandwidth drifts between runs. bench-1b's shapes: 8 layers of 8 packed experts (bf16, int8 or
int4), two routed per call at one row (the same random routing for both copies), and the LM head
(32000 x 1024 bf16) through small_linear. Each pass alternates which copy goes first.

    python benchmarks/ab_weight_pages.py --format bf16 --passes 30
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_kernels import dispatch  # noqa: E402
from cpu_kernels.expert_pack import bf16_matrix, pack_experts  # noqa: E402
from cpu_kernels.expert_quant import quantize  # noqa: E402
from moelight.runtime.fused_experts import on_huge_pages  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402

LAYERS, EXPERTS, HIDDEN, INTER, VOCAB = 8, 8, 1024, 3584, 32000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("bf16", "int8", "int4"), default="bf16")
    ap.add_argument("--passes", type=int, default=30)
    a = ap.parse_args()
    if not dispatch.small_linear_available():
        raise SystemExit("needs the C++ kernels")
    torch.manual_seed(0)
    small, huge = [], []
    for _ in range(LAYERS):
        gu = torch.randn(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16) * 0.02
        dn = torch.randn(EXPERTS, HIDDEN, INTER, dtype=torch.bfloat16) * 0.02
        mats = (bf16_matrix(gu), bf16_matrix(dn)) if a.format == "bf16" else (quantize(gu, a.format, 128),
                                                                              quantize(dn, a.format, 128))
        packed = pack_experts(*mats)
        small.append(packed)
        huge.append(on_huge_pages(dataclasses.replace(packed)))
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    head_huge = huge_copy(head)
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    weights = torch.tensor([[0.6, 0.4]])
    routes = [torch.randperm(EXPERTS)[:2].view(1, 2) for _ in range(LAYERS * a.passes + LAYERS)]

    def experts(layers, i):
        for j, p in enumerate(layers):
            dispatch.expert_mix(x, routes[i * LAYERS + j], weights, p)

    cases = {"experts 4 KiB": lambda i: experts(small, i), "experts huge": lambda i: experts(huge, i),
             "LM head 4 KiB": lambda i: dispatch.small_linear(x, head),
             "LM head huge": lambda i: dispatch.small_linear(x, head_huge)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for i in range(a.passes):
        for pair in (names[0:2], names[2:4]):
            for name in (pair if i % 2 else pair[::-1]):
                t0 = time.perf_counter()
                cases[name](i)
                times[name].append(time.perf_counter() - t0)
    expert_bytes = sum(p.nbytes() for p in small) / EXPERTS * 2  # two experts a layer
    print(f"{a.format}, {a.passes} alternated passes; ms min / median / max, GB/s at the median")
    for name, ts in times.items():
        ts = sorted(ts)
        nbytes = expert_bytes if name.startswith("experts") else head.numel() * 2
        med = statistics.median(ts)
        print(f"  {name:14s} {1e3 * ts[0]:6.2f} / {1e3 * med:6.2f} / {1e3 * ts[-1]:6.2f}  {nbytes / med / 1e9:5.1f}")


if __name__ == "__main__":
    main()
