"""A batch-1 decode step's streamed weights on 4 KiB pages against the same weights on 2 MiB huge pages.

The CPU engine now copies the packed experts and the plain bf16 weights small_linear reads onto huge
pages (moelight.runtime.host_memory.huge_copy); this measures what that buys, in one process because
the host's bandwidth drifts between runs. bench-1b's shapes: 8 layers of 8 packed experts (bf16, int8 or
int4), two routed per token at --tokens rows (one: a batch-1 step; the same random routing for both
copies), and at up to 4 rows the LM head (32000 x 1024 bf16) through small_linear. Each pass alternates
which copy goes first.

    python benchmarks/ab_weight_pages.py --format bf16 --passes 30
    python benchmarks/ab_weight_pages.py --format bf16 --passes 8 --tokens 256    # a README-job step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench1b_experts import EXPERTS, HIDDEN, LAYERS, TOP_K, dense_layer, huge_pages_copy, pack_layer, random_routes  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402

VOCAB = 32000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("bf16", "int8", "int4"), default="bf16")
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=1, help="rows per call (a decode step's batch)")
    a = ap.parse_args()
    if not dispatch.small_linear_available():
        raise SystemExit("needs the C++ kernels")
    torch.manual_seed(0)
    small, huge = [], []
    for _ in range(LAYERS):
        packed = pack_layer(*dense_layer(), a.format, huge=False)
        small.append(packed)
        huge.append(huge_pages_copy(packed))
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16)
    head_huge = huge_copy(head)
    x = torch.randn(a.tokens, HIDDEN, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(a.tokens, TOP_K), -1)
    routes = random_routes(a.tokens, LAYERS * a.passes + LAYERS)

    def experts(layers, i):
        for j, p in enumerate(layers):
            dispatch.expert_mix(x, routes[i * LAYERS + j], weights, p)

    cases = {"experts 4 KiB": lambda i: experts(small, i), "experts huge": lambda i: experts(huge, i)}
    if a.tokens <= dispatch.SMALL_LINEAR_ROWS:
        cases |= {"LM head 4 KiB": lambda i: dispatch.small_linear(x, head),
                  "LM head huge": lambda i: dispatch.small_linear(x, head_huge)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for i in range(a.passes):
        for pair in (names[j:j + 2] for j in range(0, len(names), 2)):
            for name in (pair if i % 2 else pair[::-1]):
                t0 = time.perf_counter()
                cases[name](i)
                times[name].append(time.perf_counter() - t0)
    touched = sum(len(torch.unique(r)) for r in routes[:LAYERS * a.passes]) / a.passes  # experts a step reads
    expert_bytes = touched * small[0].nbytes() / EXPERTS
    print(f"{a.format}, T = {a.tokens}, {a.passes} alternated passes; ms min / median / max, GB/s at the median")
    for name, ts in times.items():
        ts = sorted(ts)
        nbytes = expert_bytes if name.startswith("experts") else head.numel() * 2
        med = statistics.median(ts)
        print(f"  {name:14s} {1e3 * ts[0]:6.2f} / {1e3 * med:6.2f} / {1e3 * ts[-1]:6.2f}  {nbytes / med / 1e9:5.1f}")


if __name__ == "__main__":
    main()
