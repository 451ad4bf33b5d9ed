"""int4 and int8 experts at T = 1 and 8 rows, cold, beside the same run's read bandwidth: for before/after runs
of the expert kernel (run it once per tree, alternating, with PYTHONPATH pointing at the tree).

bench-1b's shapes (8 layers of 8 packed experts on huge pages, hidden 1024, width 3584, two routed per token).
Each pass: a 256 MiB stream_read (the host's read bandwidth, which evicts the experts), then one decode
step's 8 layer calls.

    python benchmarks/ab_expert_quant_cold.py branch 20
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench1b_experts import EXPERTS, HIDDEN, LAYERS, TOP_K, quantized_layers, random_routes, timed_pass  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight.runtime.host_memory import huge_copy  # noqa: E402


def main() -> None:
    dispatch.kernel_backend()
    tag, passes = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    layers = quantized_layers()
    big = huge_copy(torch.ones(64 * 2**20, dtype=torch.float32))
    for t in (1, 8):
        x, w = torch.randn(t, HIDDEN, dtype=torch.bfloat16), torch.softmax(torch.randn(t, TOP_K), -1)
        routes = random_routes(t, LAYERS * passes)
        for f in ("int4", "int8"):
            ts, bw = [], []
            for i in range(passes):
                b, t_s = timed_pass(big, layers[f], routes[i * LAYERS:(i + 1) * LAYERS], x, w)
                bw.append(b)
                ts.append(t_s)
            nb = sum(len(torch.unique(r)) for r in routes) / passes * layers[f][0].nbytes() / EXPERTS
            med, bwm = statistics.median(ts), statistics.median(bw)
            print(f"{tag} {f} T={t}: ms min {1e3 * min(ts):.2f} med {1e3 * med:.2f} | {nb / 1e6:.1f} MB "
                  f"{nb / med / 1e9:.1f} GB/s | read {bwm / 1e9:.1f} GB/s | share {nb / med / bwm * 100:.0f}%")


if __name__ == "__main__":
    main()
