"""The README job locally and through Ray (`moelight run --ray`, a local cluster) with 1 and 2 replicas.

Each configuration runs as its own `moelight run` process, alternating, so a change of host state
hits all of them; the figure is the whole command's wall time (start-up, load, generation, writing)
and the report's end-to-end tok/s. Ray's overhead = Ray 1 replica's wall time / local's - 1.

    python benchmarks/bench_ray.py [--runs 2] [--requests 256] [--output benchmarks/results/ray.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"local": [], "ray, 1 replica": ["--ray", "local", "--ray-replicas", "1"],
           "ray, 2 replicas": ["--ray", "local", "--ray-replicas", "2"]}


def run_once(extra: list[str], requests: int, gen: int, out: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "moelight", "run", "--dataset", str(ROOT / "workloads/examples/prompts.jsonl"),
           "--model", "bench-1b", "--load-format", "dummy", "--num-requests", str(requests), "--gen-len", str(gen),
           "--ignore-eos", "--output", str(out), "--overwrite", "--no-progress", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    return wall, json.loads(out.with_name(out.name + ".report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    walls: dict[str, list[float]] = {k: [] for k in CONFIGS}
    e2e: dict[str, list[float]] = {k: [] for k in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):
            for name, extra in CONFIGS.items():
                wall, report = run_once(extra, args.requests, args.gen, Path(tmp) / "out.jsonl")
                walls[name].append(wall)
                e2e[name].append(report["end_to_end_tokens_per_s"])
                print(f"{name}: {wall:.1f} s wall, {report['end_to_end_tokens_per_s']:.1f} tok/s end-to-end",
                      flush=True)
    base = statistics.median(walls["local"])
    lines = [f"{args.requests} requests x {args.gen} tokens, bench-1b bf16 (the README job), {args.runs} runs, "
             "median [min-max]:", "",
             "| configuration | wall s | end-to-end tok/s (report) | tokens / wall s | wall vs local |",
             "|---|---|---|---|---|"]
    tokens = args.requests * args.gen
    for name in CONFIGS:
        w = walls[name]
        lines.append(f"| {name} | {statistics.median(w):.1f} [{min(w):.1f}-{max(w):.1f}] | "
                     f"{statistics.median(e2e[name]):.1f} [{min(e2e[name]):.1f}-{max(e2e[name]):.1f}] | "
                     f"{tokens / statistics.median(w):.1f} | {statistics.median(w) / base - 1:+.1%} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(f"# moelight run, local and on Ray\n\nCommand: `python benchmarks/bench_ray.py "
                               f"--runs {args.runs} --requests {args.requests}`\n\n{text}\n")


if __name__ == "__main__":
    main()
