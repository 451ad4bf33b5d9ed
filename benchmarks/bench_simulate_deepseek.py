"""DeepSeek-V2-Lite against Mixtral 8x7B on a simulated T4 (and L4): the planned policy and the CGOPipe
task graph timed with HRM costs (what `moelight plan` and `moelight simulate` print), side by side.

What the latent cache changes: a V2-Lite token keeps 27 x 1,152 B in fp16 (31 KiB) against Mixtral's
32 x 4,096 B (128 KiB), so the host's KV cache holds ~4x the sequences, and CPU attention reads ~4x
fewer bytes per token of context; the table says where each plan's batch N and step time are bound.

    python benchmarks/bench_simulate_deepseek.py --output benchmarks/results/simulate_deepseek.md
    python benchmarks/bench_simulate_deepseek.py --hardware t4     # one GPU preset

Equivalent commands: `moelight simulate --model deepseek-v2-lite --hardware t4 --policy auto` and
`moelight simulate --model mixtral-8x7b --hardware t4 --policy auto` (`moelight plan` for the policy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from markdown_report import commit, emit  # noqa: E402

from hrm import WorkloadSpec, get_hardware, get_model  # noqa: E402
from hrm import operators as ops  # noqa: E402
from hrm.dtypes import dtype_bytes  # noqa: E402
from moelight.pipeline.schedule_simulator import simulate_policy  # noqa: E402
from optimizer import plan  # noqa: E402

MODELS = ("deepseek-v2-lite", "mixtral-8x7b")
GiB = 2**30


def row(hw_name: str, model: str, wl: WorkloadSpec) -> dict:
    hw, m = get_hardware(hw_name), get_model(model)
    dtype = hw.preferred_dtype()
    res = plan(hw, m, wl, dtype=dtype)
    sim = simulate_policy(hw, m, wl, res.policy, "cgopipe")
    per_token = ops.kv_bytes_per_token_layer(m, dtype_bytes(dtype)) * m.num_layers
    host_free = res.cpu_capacity - sum(v for k, v in res.cpu_memory.items() if k != "kv_cache")
    return {"hw": hw_name, "model": model, "params": m.total_params() / 1e9, "kv_token_kib": per_token / 1024,
            "n": res.policy.batch_size, "mu": res.policy.micro_batch_size, "kv_gib": res.cpu_memory["kv_cache"] / GiB,
            "n_host": int(host_free / (per_token * wl.max_context)), "plan_e2e": res.e2e_tok_s,
            "plan_decode": res.decode_tok_s, "binding": res.binding, "sim_e2e": sim.e2e_tok_s,
            "sim_decode": sim.decode_tok_s, "sim_layer_ms": sim.layer_seconds * 1e3, "sim_bound": sim.bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", nargs="+", default=["t4", "l4"])
    ap.add_argument("--prompt-len", type=int, default=77)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    wl = WorkloadSpec(args.prompt_len, args.gen_len, 418)
    rows = [row(h, m, wl) for h in args.hardware for m in MODELS]
    lines = [f"# DeepSeek-V2-Lite against Mixtral 8x7B, simulated (MT-Bench-like: prompt {args.prompt_len}, "
             f"gen {args.gen_len})", "", f"`python benchmarks/bench_simulate_deepseek.py` at {commit()} (HRM presets, "
             "the GPUs' 16-bit type)", "",
             "| hardware | model | params (B) | KV / token (KiB) | plan N / mu | KV cache (GiB) | N the host's "
             "memory allows | plan e2e / decode tok/s, bound | simulated e2e / decode tok/s | simulated layer (ms), "
             "bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['hw']} | {r['model']} | {r['params']:.1f} | {r['kv_token_kib']:.1f} | "
                     f"{r['n']} / {r['mu']} | {r['kv_gib']:.1f} | {r['n_host']:,} | "
                     f"{r['plan_e2e']:.0f} / {r['plan_decode']:.0f}, "
                     f"{r['binding']} | {r['sim_e2e']:.0f} / {r['sim_decode']:.0f} | {r['sim_layer_ms']:.1f}, "
                     f"{r['sim_bound']} |")
    emit(lines, args.output)


if __name__ == "__main__":
    main()
