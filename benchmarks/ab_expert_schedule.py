"""The expert kernel's two decode schedules in one process: strip-parallel and by expert
(torch.ops.moelight.set_expert_schedule), int4 and int8 at T = 1 and 8, cold, beside the same run's
read bandwidth. bench-1b's shapes on huge pages (bench1b_experts.py); each pass per schedule, in
alternating order: a 256 MiB stream_read (which evicts the experts), then one decode step's 8 layer calls.

    python benchmarks/ab_expert_schedule.py 20 [tokens ...]    (SCHEDULES=strips,auto: the rule instead)
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench1b_experts import EXPERTS, HIDDEN, LAYERS, TOP_K, quantized_layers, random_routes, timed_pass  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402

SCHEDULES = tuple(os.environ.get("SCHEDULES", "strips,experts").split(","))


def main() -> None:
    dispatch.kernel_backend()
    passes = int(sys.argv[1])
    tokens = [int(t) for t in sys.argv[2:]] or [1, 8]
    torch.manual_seed(0)
    layers = quantized_layers()
    big = huge_copy(torch.ones(64 * 2**20, dtype=torch.float32))
    for t in tokens:
        x, w = torch.randn(t, HIDDEN, dtype=torch.bfloat16), torch.softmax(torch.randn(t, TOP_K), -1)
        routes = random_routes(t, LAYERS * passes)
        for f in ("int4", "int8"):
            ts: dict[str, list[float]] = {s: [] for s in SCHEDULES}
            bw = []
            for i in range(passes):
                for s in SCHEDULES if i % 2 == 0 else SCHEDULES[::-1]:
                    torch.ops.moelight.set_expert_schedule(s)
                    b, t_s = timed_pass(big, layers[f], routes[i * LAYERS:(i + 1) * LAYERS], x, w)
                    bw.append(b)
                    ts[s].append(t_s)
            torch.ops.moelight.set_expert_schedule("auto")
            nb = sum(len(torch.unique(r)) for r in routes) / passes * layers[f][0].nbytes() / EXPERTS
            bwm = statistics.median(bw)
            for s in SCHEDULES:
                med = statistics.median(ts[s])
                ms = f"min {1e3 * min(ts[s]):.2f} med {1e3 * med:.2f} max {1e3 * max(ts[s]):.2f}"
                print(f"{s:8s} {f} T={t}: ms {ms} | {nb / 1e6:.1f} MB {nb / med / 1e9:.1f} GB/s | "
                      f"read {bwm / 1e9:.1f} GB/s | share {nb / med / bwm * 100:.0f}%")


if __name__ == "__main__":
    main()
