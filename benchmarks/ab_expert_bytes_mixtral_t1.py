"""Bytes per second of one Mixtral-8x7B-shaped expert call at one row, bf16 against int4, beside a plain
read: whether bf16's batch-1 step reads its weights more slowly than int4's (it does: the measured int4 /
bf16 decode ratio exceeds the equal-bandwidth ceiling, benchmarks/results/quantized_decode_mixtral_shape.md).

`--layers` layers of 8 packed experts (hidden 4096, width 14336) in each format, on huge pages as pack_moe
holds them (bf16 from dummy levels, int4 drawn as codes as `--load-format dummy` does); each pass calls one
layer's 2 routed experts in each format and stream_reads a 512 MiB huge-page buffer, the order alternating
pass by pass. bf16 layers are 2.8 GB each (3 layers: ~12 GB resident).

    python benchmarks/ab_expert_bytes_mixtral_t1.py --layers 3 --passes 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_kernels import dispatch  # noqa: E402
from cpu_kernels.expert_pack import bf16_matrix, pack_experts  # noqa: E402
from moelight.loading.dummy_values import uniform_levels_  # noqa: E402
from moelight.models.expert_format import quantize_format  # noqa: E402
from moelight.models.quantized_experts import QuantizedExperts  # noqa: E402
from moelight.runtime.fused_experts import expert_alloc  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402

H, F, E, TOP_K = 4096, 14336, 8, 2


def layers(n: int, gen: torch.Generator) -> dict[str, list]:
    form = quantize_format("int4", (H, F))
    out: dict[str, list] = {"bf16": [], "int4": []}
    for _ in range(n):
        gu = uniform_levels_(torch.empty(E, 2 * F, H, dtype=torch.bfloat16), 0.0346, gen)
        dn = uniform_levels_(torch.empty(E, H, F, dtype=torch.bfloat16), 0.0346, gen)
        out["bf16"].append(pack_experts(bf16_matrix(gu), bf16_matrix(dn), alloc=expert_alloc))
        del gu, dn
        q13, q2 = QuantizedExperts(form, E, 2 * F, H), QuantizedExperts(form, E, H, F)
        q13.fill_dummy(gen)
        q2.fill_dummy(gen)
        out["int4"].append(pack_experts(q13.matrix(), q2.matrix(), alloc=expert_alloc))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--passes", type=int, default=24)
    a = ap.parse_args()
    dispatch.kernel_backend()  # loads the extension (its ops)
    gen = torch.Generator().manual_seed(0)
    packed = layers(a.layers, gen)
    x = torch.randn(1, H, dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(1, TOP_K), -1)
    big = huge_copy(torch.ones(128 * 2**20, dtype=torch.float32))
    times: dict[str, list[float]] = {"bf16": [], "int4": [], "read": []}
    for i in range(a.passes):
        route = torch.randperm(E)[:TOP_K].view(1, TOP_K)
        for name in (list(times) if i % 2 else list(times)[::-1]):
            t0 = time.perf_counter()
            if name == "read":
                torch.ops.moelight.stream_read(big)
            else:
                dispatch.expert_mix(x, route, w, packed[name][i % a.layers])
            times[name].append(time.perf_counter() - t0)
    print(f"one expert call at one row ({TOP_K} of {E} experts), {a.passes - 3} passes after 3 warm-up ones; "
          "ms min / median / max, GB/s at the median")
    for name, ts in times.items():
        nbytes = big.numel() * 4 if name == "read" else TOP_K * packed[name][0].nbytes() / E
        ts = sorted(ts[3:])
        med = statistics.median(ts)
        print(f"  {name:5s} {nbytes / 1e6:6.1f} MB  {1e3 * ts[0]:6.2f} / {1e3 * med:6.2f} / {1e3 * ts[-1]:6.2f}  "
              f"{nbytes / med / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
