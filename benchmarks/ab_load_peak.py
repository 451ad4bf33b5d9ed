"""Peak resident memory and load time of `moelight run`'s load, this checkout against another one (a snapshot of
the code before a change), runs alternated: old, new, then new, old, ...

Each run is `python -m moelight run` on one prompt, batch 1, one new token, dummy weights (the bench-1b preset, or
a Mixtral-shaped preset cut to `--layers` layers as bench_quantized_decode.py does), in a fresh process with
PYTHONPATH at the checkout; the figures are the run report's peak_memory_bytes (VmHWM) and load_seconds (build,
dummy fill and packing). Under the shared lock:

    flock /tmp/cpu.lock python benchmarks/ab_load_peak.py --base /tmp/old --model mixtral-8x7b --layers 2 \\
        --quantize none int4 --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
from decode_ceiling import shape_config  # noqa: E402

PROMPTS = ROOT / "workloads/examples/prompts.jsonl"
GIB = 2**30


def one_run(code: Path, model: str, quantize: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "moelight", "run", "--dataset", str(PROMPTS), "--model", model,
           "--load-format", "dummy", "--num-requests", "1", "--batch-size", "1", "--gen-len", "1", "--ignore-eos",
           "--overwrite", "--no-progress", "--output", str(out)]
    if Path(model).is_dir():
        cmd += ["--tokenizer", "byte"]
    if quantize != "none":
        cmd += ["--quantize", quantize]
    env = dict(os.environ, PYTHONPATH=str(code))
    res = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{code}: {' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    rep = json.loads(out.with_name(out.name + ".report.json").read_text())
    return {"peak_gib": rep["peak_memory_bytes"] / GIB, "load_s": rep["load_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (the code before the change)")
    ap.add_argument("--model", default="bench-1b")
    ap.add_argument("--layers", type=int, help="cut a Mixtral-shaped preset to this many layers")
    ap.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "int4"])
    ap.add_argument("--pairs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model if args.layers is None else str(shape_config(args.model, args.layers, Path(tmp) / "m"))
        sides = {"old": args.base.resolve(), "new": ROOT}
        for q in args.quantize:
            got: dict[str, list[dict]] = {"old": [], "new": []}
            for i in range(args.pairs):
                for side in (("old", "new") if i % 2 == 0 else ("new", "old")):
                    r = one_run(sides[side], model, q, Path(tmp) / "out.jsonl")
                    got[side].append(r)
                    print(f"{q} pair {i} {side}: peak {r['peak_gib']:.2f} GiB, load {r['load_s']:.2f} s", flush=True)
            for side in ("old", "new"):
                peaks = [r["peak_gib"] for r in got[side]]
                loads = [r["load_s"] for r in got[side]]
                print(f"{q} {side}: peak GiB min/median/max {min(peaks):.2f}/{statistics.median(peaks):.2f}/"
                      f"{max(peaks):.2f}; load s {min(loads):.2f}/{statistics.median(loads):.2f}/{max(loads):.2f}")


if __name__ == "__main__":
    main()
