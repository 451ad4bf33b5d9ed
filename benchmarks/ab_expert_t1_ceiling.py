"""Where the quantized expert kernel loses at one row: its cold time against a pure read of the same bytes
and against its own time with the weights hot.

bench-1b's shapes (8 layers of 8 packed experts, hidden 1024, width 3584, two routed per call at T rows),
on huge pages as the engine holds them (fused_experts.on_huge_pages). Per pass, alternated:
- `kernel cold`: 8 layers, each call reading experts no recent call read (a decode step),
- `read`: torch.ops.moelight.stream_read of the same experts' codes and scales (2 threads, sequential
  64-bit loads), the same-run read bandwidth,
- `kernel L3-hot`: one layer's call 8 times (its 2 experts, ~12 MB int4, stay in the 480 MB L3),
- `kernel L2-hot`: a narrow copy (width 512, ~1.6 MB for 2 int4 experts: in the two cores' L2) called
  8 x 8 times; its GB/s is the kernel's instruction throughput with no memory wait (and more of the
  per-call overhead: 64 calls),
- `roof`: stream_read of a 256 MiB huge-page buffer (the host's read bandwidth in this run).

    python benchmarks/ab_expert_t1_ceiling.py --format int4 --passes 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench1b_experts import EXPERTS, HIDDEN, INTER, LAYERS, TOP_K, dense_layer, pack_layer, random_routes  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402

NARROW = 512


def _packed(fmt: str, inter: int):
    return pack_layer(*dense_layer(inter), fmt)


def _expert_tensors(p, e: int) -> list[torch.Tensor]:
    return [t[e] for t in (p.w13, p.s13, p.z13, p.w2, p.s2, p.z2) if isinstance(t, torch.Tensor)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=("int8", "int4"), default="int4")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--passes", type=int, default=20)
    a = ap.parse_args()
    torch.manual_seed(0)
    layers = [_packed(a.format, INTER) for _ in range(LAYERS)]
    narrow = _packed(a.format, NARROW)
    big = huge_copy(torch.ones(64 * 2**20, dtype=torch.float32))
    x = torch.randn(a.tokens, HIDDEN, dtype=torch.bfloat16)
    weights = torch.softmax(torch.randn(a.tokens, TOP_K), -1)
    routes = random_routes(a.tokens, LAYERS * (a.passes + 1))
    touched = [len(torch.unique(r)) for r in routes]

    def cold(i):
        for j, p in enumerate(layers):
            dispatch.expert_mix(x, routes[i * LAYERS + j], weights, p)

    def read(i):
        for j, p in enumerate(layers):
            for e in torch.unique(routes[i * LAYERS + j]).tolist():
                for t in _expert_tensors(p, e):
                    torch.ops.moelight.stream_read(t)

    def l3_hot(i):
        for _ in range(LAYERS):
            dispatch.expert_mix(x, routes[0], weights, layers[0])

    def l2_hot(i):
        for _ in range(LAYERS * 8):
            dispatch.expert_mix(x, routes[0], weights, narrow)

    cases = {"kernel cold": cold, "read": read, "kernel L3-hot": l3_hot, "kernel L2-hot": l2_hot,
             "roof": lambda i: torch.ops.moelight.stream_read(big)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    l3_hot(0), l2_hot(0)
    for i in range(a.passes):
        for name in (list(cases) if i % 2 else list(cases)[::-1]):
            t0 = time.perf_counter()
            cases[name](i)
            times[name].append(time.perf_counter() - t0)
    per_expert = layers[0].nbytes() / EXPERTS
    cold_bytes = statistics.mean(touched[:LAYERS * a.passes]) * LAYERS * per_expert
    nbytes = {"kernel cold": cold_bytes, "read": cold_bytes, "kernel L3-hot": touched[0] * LAYERS * per_expert,
              "kernel L2-hot": touched[0] * LAYERS * 8 * narrow.nbytes() / EXPERTS, "roof": big.numel() * 4}
    print(f"{a.format}, T = {a.tokens}, {a.passes} alternated passes; ms min / median / max, GB/s at the median")
    for name, ts in times.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        print(f"  {name:14s} {1e3 * ts[0]:6.2f} / {1e3 * med:6.2f} / {1e3 * ts[-1]:6.2f}  "
              f"{nbytes[name] / 1e6:6.1f} MB  {nbytes[name] / med / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
