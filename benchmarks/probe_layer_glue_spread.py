"""How far the layer-glue probe (moelight/profiling/layer_glue.py) moves between repeats on one host: the
probe run N times in a row against one profile's GEMM curve, each printing the glue it found at its two token
counts and the line through them (a fixed cost per layer pass plus element-wise bytes at a rate).

The glue is a difference: the measured rest of a layer pass (beyond the timed expert and attention kernels)
less the HRM's GEMM terms from the profile's curve. On a host with fast and slow phases (a shared VM) the two
sides can come from different phases, and the README job's prediction moves with it.

    python benchmarks/probe_layer_glue_spread.py --hardware ~/.cache/moelight/hardware.json --repeats 6 [--full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", type=Path, required=True, help="a profile JSON (its GEMM curve prices the GEMMs)")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--full", action="store_true", help="the full profile's samples (10), not the quick one's (4)")
    a = ap.parse_args()

    import torch

    from hrm import HardwareSpec
    from moelight.profiling import layer_glue
    from moelight.profiling.machine_profile import _gemm_seconds_of

    gemm_seconds = _gemm_seconds_of(HardwareSpec.load(a.hardware).cpu)
    fit = layer_glue.glue_line

    def shown(glue_s, nbytes, fallback):
        overhead, rate = fit(glue_s, nbytes, fallback)
        print(f"glue at {layer_glue.TOKENS[0]} / {layer_glue.TOKENS[1]} tokens: {glue_s[0] * 1e3:.3f} / "
              f"{glue_s[1] * 1e3:.3f} ms a layer -> {overhead * 1e3:.3f} ms + element-wise at {rate / 1e9:.1f} GB/s",
              flush=True)
        return overhead, rate

    layer_glue.glue_line = shown
    for _ in range(a.repeats):
        layer_glue.measure_layer_glue(torch.bfloat16, gemm_seconds, not a.full, 0.3e-3)


if __name__ == "__main__":
    main()
