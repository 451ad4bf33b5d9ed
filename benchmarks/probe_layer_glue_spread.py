"""How far the layer-glue probe (moelight/profiling/layer_glue.py) moves between repeats on one host: the
probe run N times in a row, each printing the glue it found at its two token counts and the line through
them (a fixed cost per layer pass plus element-wise bytes at a rate).

The glue is a difference: the rest of a layer pass beyond the timed expert and attention kernels, less the
same layers' GEMMs timed alone right after each step. On a host with fast and slow phases (a shared VM) the
spread of repeats is what moves the README job's prediction between profiles.

    python benchmarks/probe_layer_glue_spread.py --repeats 6 [--full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--full", action="store_true", help="the full profile's samples (10), not the quick one's (4)")
    a = ap.parse_args()
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: give 1 or more")

    import torch

    from moelight.profiling import layer_glue

    fit = layer_glue.glue_line

    def shown(glue_s, nbytes, fallback):
        overhead, rate = fit(glue_s, nbytes, fallback)
        print(f"glue at {layer_glue.TOKENS[0]} / {layer_glue.TOKENS[1]} tokens: {glue_s[0] * 1e3:.3f} / "
              f"{glue_s[1] * 1e3:.3f} ms a layer -> {overhead * 1e3:.3f} ms + element-wise at {rate / 1e9:.1f} GB/s",
              flush=True)
        return overhead, rate

    layer_glue.glue_line = shown
    for _ in range(a.repeats):
        layer_glue.measure_layer_glue(torch.bfloat16, not a.full, 0.3e-3)


if __name__ == "__main__":
    main()
