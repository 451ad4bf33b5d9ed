"""How long the planner takes, against the same search solving every grid point.

`moelight run` and every `LLM.generate` call plan their job, so the solve time is paid per call.
The search (optimizer/search.py) evaluates the all-CPU placement at its single point and prunes
grid points by a lower bound of their LP; the peer, in the same run, is the same search with
neither (every point's vertices enumerated). Both must return the same policy; the table says so.

    python benchmarks/bench_planner_time.py --repeat 3 --output benchmarks/results/planner_time.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from markdown_report import commit, emit  # noqa: E402

import optimizer.search as search  # noqa: E402
from hrm import WorkloadSpec, get_hardware, get_model  # noqa: E402
from optimizer.lp import enumerate_vertices, solve_grid  # noqa: E402

CASES = [("cpu-server", "bench-1b"), ("cpu-server", "mixtral-8x7b"), ("t4", "mixtral-8x7b"), ("l4", "mixtral-8x7b"),
         ("t4", "deepseek-v2-lite"), ("s9", "mixtral-8x7b")]
WORKLOAD = WorkloadSpec(77, 128, 418)  # MT-Bench-like
FIRST = search._FIRST  # the search's own setting, restored after the every-point runs


def _timed(hw, model, full: bool):
    search.solve_grid, search._FIRST = (enumerate_vertices, 10**12) if full else (solve_grid, FIRST)
    t0 = time.perf_counter()
    result = search.plan(hw, model, WORKLOAD)
    return time.perf_counter() - t0, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    lines = [f"At {commit()}; workload: prompt {WORKLOAD.prompt_len:g}, gen {WORKLOAD.gen_len}; best of {a.repeat}, "
             "alternated\n",
             "| hardware | model | plan ms | every point solved, ms | speed-up | same policy |",
             "|---|---|---|---|---|---|"]
    for hw_name, model_name in CASES:
        hw, model = get_hardware(hw_name), get_model(model_name)
        best = {False: float("inf"), True: float("inf")}
        results = {}
        for _ in range(a.repeat):
            for full in (False, True):
                s, results[full] = _timed(hw, model, full)
                best[full] = min(best[full], s)
        same = results[False].policy == results[True].policy
        lines.append(f"| {hw_name} | {model_name} | {best[False] * 1e3:.0f} | {best[True] * 1e3:.0f} | "
                     f"{best[True] / best[False]:.1f}x | {'yes' if same else 'NO'} |")
    search.solve_grid, search._FIRST = solve_grid, FIRST
    emit(lines, a.output)


if __name__ == "__main__":
    main()
