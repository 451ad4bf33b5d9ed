"""Cold-call times of the latent (MLA) decode kernel, one short process per side for A/B alternation
with a base worktree: bench_latent_attention.py's best of 3 per case moves with the host's other
tenants by more than a kernel change, so many short alternated processes resolve smaller changes.

    S=$PWD/benchmarks/ab_latent_cold.py  # run from each side's root, so each imports its own kernels
    for i in 1 2 3 4; do for d in /tmp/base $PWD; do
      (cd $d && PYTHONPATH=$d python $S --isa avx2); done; done

Prints `case|kernel|best ms|median ms` of --calls calls, each after an L3 eviction.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())  # the side being measured: its cpu_kernels and its bench script
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))

from bench_latent_attention import SHAPES, case  # noqa: E402

import cpu_kernels  # noqa: E402

KERNELS = ("latent 16 x (512+64)", "latent 16 x (512+64), paged", "GQA bench-1b 16/4 x 64")  # GQA: control


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="avx2")
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    assert cpu_kernels.kernel_backend() != "torch" and torch.ops.moelight.set_isa(args.isa) == args.isa
    evict = torch.ones(2**26)
    for b, ctx in ((256, 117), (16, 2048)):
        for name in KERNELS:
            fn, _, _ = case(SHAPES[name], b, ctx, torch.bfloat16)
            fn()
            ts = []
            for _ in range(args.calls):
                evict.sum()
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
            print(f"{b}x{ctx}|{name}|{min(ts):.2f}|{statistics.median(ts):.2f}", flush=True)


if __name__ == "__main__":
    main()
