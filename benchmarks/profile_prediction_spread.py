"""How far the README job's HRM prediction moves between quick profiles of one host, and which measured
term moves it: for each profile JSON, the job's predicted tok/s (the job run until it prints its policy
line, then stopped: the prediction a user sees) beside the terms that price its decode step on the CPU
(the layer glue at 256 tokens, the HRM's projection GEMMs at 256 rows, the bf16 expert kernel at 64 rows
per expert: a decode step of 256 sequences, top-2 of 8 experts).

    python benchmarks/profile_prediction_spread.py --take 4 --dir /tmp/profiles   # take 4 quick profiles first
    python benchmarks/profile_prediction_spread.py /tmp/profiles/*.json            # or read profiles taken elsewhere
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOB = ["run", "--dataset", "workloads/examples/prompts.jsonl", "--model", "bench-1b", "--load-format", "dummy",
       "--num-requests", "256", "--gen-len", "64", "--ignore-eos", "--overwrite"]


def job_prediction(profile: Path, out: Path) -> float:
    """The README job's predicted end-to-end tok/s with `profile`: its policy line, before the model loads."""
    cmd = [sys.executable, "-m", "moelight", *JOB, "--output", str(out), "--hardware", str(profile)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:
            if line.startswith("policy (") and (m := re.search(r"predicted ([\d.]+) tok/s", line)):
                return float(m.group(1))
    finally:
        proc.kill()
        proc.wait()
    raise SystemExit(f"{profile}: the job printed no policy line (run it by hand with --hardware {profile})")


def decode_terms(profile: Path) -> tuple[float, float, float]:
    """(layer glue at 256 tokens s, projection and router GEMMs at 256 rows s, bf16 experts at 64 rows FLOP/s)."""
    from hrm import HardwareSpec, costs
    from hrm import operators as ops
    from hrm.model import model_from_hf_config
    from moelight.loading.presets import PRESETS

    cpu = HardwareSpec.load(profile).cpu
    spec = model_from_hf_config(PRESETS["bench-1b"].to_hf_dict(), "bench-1b")
    nbytes = ops.pre_attention_elementwise(spec, 256, 2).bytes + ops.post_attention_elementwise(spec, 256, 2).bytes
    glue = cpu.layer_overhead_s + (nbytes / cpu.elementwise_bandwidth if cpu.elementwise_bandwidth else 0.0)
    gemms = sum(costs.op_time(op(spec, 256.0, 2.0), cpu, "bfloat16") for op in (ops.qkv_proj, ops.o_proj, ops.router))
    experts = dict((int(r), f) for r, f in cpu.expert_gemm_flops.get("bfloat16", []))
    return glue, gemms, experts.get(64, 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="*", type=Path, help="profile JSONs to read")
    ap.add_argument("--take", type=int, default=0, help="take this many quick profiles first (into --dir)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/moelight_profiles"))
    a = ap.parse_args()
    if a.take < 0:
        raise SystemExit(f"--take {a.take}: give a count of profiles to take, 0 or more")
    profiles = list(a.profiles)
    missing = [str(p) for p in profiles if not p.is_file()]
    if missing:
        raise SystemExit(f"no such profile: {', '.join(missing)} "
                         "(write one with `moelight profile --quick --output PATH`)")
    a.dir.mkdir(parents=True, exist_ok=True)
    for i in range(a.take):
        path = a.dir / f"quick{i + 1}.json"
        subprocess.run([sys.executable, "-m", "moelight", "profile", "--quick", "--output", str(path)], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL)
        profiles.append(path)
    if not profiles:
        raise SystemExit("no profiles: name profile JSONs or give --take N")
    print("| profile | predicted tok/s | glue at 256 tokens, ms | GEMMs at 256 rows, ms "
          "| bf16 experts at 64 rows, GFLOP/s |")
    print("|---|---|---|---|---|")
    predicted = []
    for p in profiles:
        pred = job_prediction(p, a.dir / "job_out.jsonl")
        glue, gemms, experts = decode_terms(p)
        predicted.append(pred)
        print(f"| {p.name} | {pred:.1f} | {glue * 1e3:.2f} | {gemms * 1e3:.2f} | {experts / 1e9:.1f} |", flush=True)
    if len(predicted) > 1:
        mid = statistics.median(predicted)
        print(f"\npredicted: median {mid:.1f}, range {min(predicted):.1f}-{max(predicted):.1f} "
              f"({(min(predicted) / mid - 1) * 100:+.0f}% / {(max(predicted) / mid - 1) * 100:+.0f}% of the median)")


if __name__ == "__main__":
    main()
