"""Tensor parallelism in the HRM: simulated throughput on the paper's S1 / S6 / S7 and the
4xT4 / 2xT4 scaling ratio, with the terms that make it (no GPU needed).

For each setting and generation length the planner picks its CGOPipe policy and the simulator
times that policy's task graph (prefill and a decode step, link and host-memory roofs applied).
The ablation re-plans S6 and S7 with one term removed at a time, to show which roof moves:
- "no host roof": host memory as fast as needed (the staging copies and the links' DMA free);
- "no all-reduce": the GPUs exchange partial sums for free (infinite interconnect, no latency);
- "paper's HRM": both removed, t GPUs = t x memory, bandwidth, FLOP/s and links (section 4.3).

    python benchmarks/bench_tp_scaling.py [--padded]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hrm import WorkloadSpec, get_hardware, get_model  # noqa: E402
from moelight.pipeline.schedule_simulator import simulate_policy  # noqa: E402
from optimizer import InfeasibleError, plan  # noqa: E402

GENS = (32, 64, 128, 256)
CASES = [("S1", "s1", "mixtral-8x7b"), ("S6", "s6", "mixtral-8x7b"), ("S7", "s7", "mixtral-8x7b"),
         ("S6", "s6", "mixtral-8x22b"), ("S7", "s7", "mixtral-8x22b")]
PAPER_RATIO = "2.77-3.38"
DTYPE = "float16"  # the T4 has no bf16 tensor cores


def ablations(hw):
    return {"full model": hw, "no host roof": replace(hw, host_bandwidth=1e30),
            "no all-reduce": replace(hw, interconnect=1e30, interconnect_latency_s=0.0),
            "paper's HRM": replace(hw, host_bandwidth=1e30, interconnect=1e30, interconnect_latency_s=0.0)}


def run(hw, model, work):
    """(simulated e2e tok/s, the plan) for the planner's CGOPipe policy, or (None, None) if none fits."""
    try:
        res = plan(hw, model, work, DTYPE, family="cgopipe")
    except InfeasibleError:
        return None, None
    return simulate_policy(hw, model, work, res.policy, "cgopipe"), res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--padded", action="store_true", help="pad prompts to 418 (MoE-Lightning (p), as the paper)")
    a = ap.parse_args()
    works = {g: WorkloadSpec(77, g, 418, a.padded) for g in GENS}
    print(f"\n### Simulated CGOPipe, MT-Bench prompt 77 (max 418{', padded' if a.padded else ''}), {DTYPE}\n")
    print("| setting | model | " + " | ".join(f"gen {g}: tok/s (N = mu x n, r_w, bound)" for g in GENS) + " |")
    print("|---|---|" + "---|" * len(GENS))
    sims = {}
    for label, hw_name, model_name in CASES:
        hw, m = get_hardware(hw_name), get_model(model_name)
        cells = []
        for g in GENS:
            sim, res = run(hw, m, works[g])
            sims[(label, model_name, g)] = sim
            if sim is None:
                cells.append("does not fit")
                continue
            p = res.policy
            cells.append(f"{sim.e2e_tok_s:.1f} ({p.batch_size} = {p.mu} x {p.n_mb}, {p.r_w:.3f}, "
                         f"{sim.bound if sim.bound != 'schedule' else res.binding})")
        print(f"| {label} ({hw.gpu_count}x T4) | {model_name} | " + " | ".join(cells) + " |")

    print(f"\n### 4xT4 / 2xT4 (S7 / S6), simulated end-to-end; the paper measures {PAPER_RATIO}x for "
          "Mixtral 8x22B\n")
    print("| model | terms | " + " | ".join(f"gen {g}" for g in GENS)
          + " | S6 / S7 per-layer decode roofs at gen 128 (ms) |")
    print("|---|---|" + "---|" * (len(GENS) + 1))
    for model_name in ("mixtral-8x22b", "mixtral-8x7b"):
        m = get_model(model_name)
        for name in ablations(get_hardware("s6")):
            ratios, roofs = [], ""
            for g in GENS:
                pair = [run(ablations(get_hardware(s))[name], m, works[g]) for s in ("s6", "s7")]
                if any(sim is None for sim, _ in pair):
                    ratios.append("-")
                    continue
                ratios.append(f"{pair[1][0].e2e_tok_s / pair[0][0].e2e_tok_s:.2f}")
                if g == 128:
                    roofs = " / ".join(
                        ", ".join(f"{k[2:]} {v * 1e3:.0f}" for k, v in res.layer_times.items()
                                  if k in ("T_link", "T_host", "T_gpu", "T_cpu")) for _, res in pair)
            print(f"| {model_name} | {name} | " + " | ".join(ratios) + f" | {roofs} |")


if __name__ == "__main__":
    main()
