"""What packing a real model's experts costs on 4 KiB pages, packed then copied onto huge pages (the engine
before), and packed straight onto huge pages (cpu_kernels.expert_pack's `alloc`, the engine now).

Why: a whole Qwen3-30B-A3B load needs most of a 24 GiB host; this packs `--layers` of its int4 layers
(128 experts, hidden 2048, intermediate 768, group 128; codes drawn at random) per variant, keeping them
alive as a load does, so every layer lands on fresh memory. Variants alternate; between variants the
process sleeps `--settle` s, so that memory it freed is handed back to the host first on a VM with free
page reporting (a fresh load's memory is fresh too). Prints ms per layer.

    python benchmarks/ab_pack_pages.py --layers 4 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_kernels import pack_experts  # noqa: E402  (the engine's packer: C++ where the kernels load)
from cpu_kernels.expert_pack import QuantMatrix  # noqa: E402
from moelight.runtime.fused_experts import on_huge_pages  # noqa: E402
from moelight.runtime.host_memory import empty_huge  # noqa: E402

E, H, F, GROUP = 128, 2048, 768, 128  # Qwen3-30B-A3B's experts


def int4_matrix(n: int, k: int, g: torch.Generator) -> QuantMatrix:
    codes = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, generator=g)
    return QuantMatrix("uint4", codes, torch.rand(E, n, k // GROUP, generator=g), None, GROUP)


VARIANTS = {
    "4 KiB pages": lambda gu, dn: pack_experts(gu, dn),
    "packed, then copied onto 2 MiB (before)": lambda gu, dn: on_huge_pages(pack_experts(gu, dn)),
    "packed onto 2 MiB (now)": lambda gu, dn: pack_experts(gu, dn, alloc=empty_huge),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=4.0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    gu, dn = int4_matrix(2 * F, H, g), int4_matrix(H, F, g)  # one layer's canonical int4 experts, reused
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            time.sleep(args.settle)
            kept = []
            t0 = time.perf_counter()
            for _ in range(args.layers):
                kept.append(VARIANTS[name](gu, dn))
            times[name].append((time.perf_counter() - t0) / args.layers)
            nbytes = kept[0].nbytes()
            del kept
            gc.collect()
    print(f"{args.layers} Qwen3-30B-A3B int4 layers ({nbytes / 2**20:.0f} MiB each) per variant, "
          f"{args.rounds} rounds, ms per layer: median (min-max)")
    for name in names:
        t = [1e3 * x for x in times[name]]
        print(f"| {name} | {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f}) |")


if __name__ == "__main__":
    main()
