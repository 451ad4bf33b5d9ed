"""The README job locally and through Ray (`moelight run --ray`) with 1 and 2 replicas.

Configurations: local; `--ray` with no address (the job starts a local cluster and pays its
start-up) with 1 and 2 replicas; `--ray auto` with 1 replica against a cluster started beforehand
with `ray start --head` (the case of a real cluster, whose start-up no job pays). Each runs as its
own `moelight run` process, alternating, so a change of host state hits all of them; the figure is
the whole command's wall time (start-up, load, generation, writing) and the report's end-to-end
tok/s. Ray's overhead = a Ray configuration's wall time / local's - 1. With two job sizes, each
configuration's wall time is split into a fixed part and a part per request (a line through the two
medians), and Ray's overhead into what it adds once per job and what it adds per request.

    python benchmarks/bench_ray.py [--runs 2] [--requests 256 1024] [--output benchmarks/results/ray.md]
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
CONFIGS = {"local": [], "ray, cluster started by the job, 1 replica": ["--ray", "local", "--ray-replicas", "1"],
           "ray, cluster started by the job, 2 replicas": ["--ray", "local", "--ray-replicas", "2"],
           "ray, running cluster (--ray auto), 1 replica": ["--ray", "auto", "--ray-replicas", "1"]}
LARGE_JOB_CONFIGS = ("local", "ray, cluster started by the job, 1 replica",
                     "ray, running cluster (--ray auto), 1 replica")


def ray_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", *args], check=True, capture_output=True, text=True)


def run_once(extra: list[str], requests: int, gen: int, out: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "moelight", "run", "--dataset", str(ROOT / "workloads/examples/prompts.jsonl"),
           "--model", "bench-1b", "--load-format", "dummy", "--num-requests", str(requests), "--gen-len", str(gen),
           "--ignore-eos", "--output", str(out), "--overwrite", "--no-progress", *extra]
    running = "auto" in extra
    if running:  # a cluster up before the job, as on a real one
        ray_cli("start", "--head", "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats")
    try:
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
    finally:
        if running:
            ray_cli("stop", "--force")
    return wall, json.loads(out.with_name(out.name + ".report.json").read_text())


def measure(requests: int, gen: int, runs: int, names: tuple[str, ...], tmp: Path,
            medians: dict) -> list[str]:
    walls: dict[str, list[float]] = {k: [] for k in names}
    e2e: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(runs):
        for name in names:
            wall, report = run_once(CONFIGS[name], requests, gen, tmp / "out.jsonl")
            walls[name].append(wall)
            e2e[name].append(report["end_to_end_tokens_per_s"])
            print(f"{requests} requests, {name}: {wall:.1f} s wall, "
                  f"{report['end_to_end_tokens_per_s']:.1f} tok/s end-to-end", flush=True)
    base = statistics.median(walls["local"])
    for name in names:
        medians.setdefault(name, {})[requests] = statistics.median(walls[name])
    lines = [f"{requests} requests x {gen} tokens, bench-1b bf16 (the README job's shape), {runs} runs, "
             "median [min-max]:", "",
             "| configuration | wall s | end-to-end tok/s (report) | tokens / wall s | wall vs local |",
             "|---|---|---|---|---|"]
    for name in names:
        w, e = walls[name], e2e[name]
        lines.append(f"| {name} | {statistics.median(w):.1f} [{min(w):.1f}-{max(w):.1f}] | "
                     f"{statistics.median(e):.1f} [{min(e):.1f}-{max(e):.1f}] | "
                     f"{requests * gen / statistics.median(w):.1f} | {statistics.median(w) / base - 1:+.1%} |")
    return lines


def split_overhead(medians: dict[str, dict[int, float]], small: int, large: int) -> list[str]:
    """Wall = fixed + per request x n through the two sizes' medians; Ray's part of each."""
    fit = {}
    for name, w in medians.items():
        if large in w:
            per = (w[large] - w[small]) / (large - small)
            fit[name] = (w[small] - per * small, per)
    base_fixed, base_per = fit["local"]
    lines = [f"Wall time as fixed + per request (through the medians at {small} and {large} requests):", "",
             "| configuration | fixed s | ms per request | Ray's fixed part s | Ray's per-request part |",
             "|---|---|---|---|---|"]
    for name, (fixed, per) in fit.items():
        ray = "–" if name == "local" else f"{fixed - base_fixed:+.1f}"
        ratio = "–" if name == "local" else f"{per / base_per - 1:+.1%}"
        lines.append(f"| {name} | {fixed:.1f} | {1e3 * per:.1f} | {ray} | {ratio} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--requests", type=int, nargs="+", default=[256])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    ray_cli("stop", "--force")  # no cluster left over: `--ray local` must start its own
    sections = []
    medians: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, requests in enumerate(args.requests):
            names = tuple(CONFIGS) if i == 0 else LARGE_JOB_CONFIGS
            sections.append("\n".join(measure(requests, args.gen, args.runs, names, Path(tmp), medians)))
    if len(args.requests) >= 2:
        sections.append("\n".join(split_overhead(medians, min(args.requests), max(args.requests))))
    text = "\n\n".join(sections)
    print(text)
    if args.output:
        sizes = " ".join(map(str, args.requests))
        args.output.write_text(f"# moelight run, local and on Ray\n\nCommand: `python benchmarks/bench_ray.py "
                               f"--runs {args.runs} --requests {sizes}`\n\n{text}\n")


if __name__ == "__main__":
    main()
