"""Decode with and without the one-pass rotary / RMSNorm kernels (cpu_kernels/csrc/norm_rotary.cpp),
in one process: the two are switched by replacing `cpu_kernels.dispatch.rotary` / `rms_norm` with
functions that decline (the model's torch ops run then), alternated run by run, so the host's
minute-to-minute drift falls on both alike.

bench-1b (dummy weights), greedy, 64 new tokens per request, prompts of 60+ tokens; decode tok/s as
`LLM.last_report` gives it, min / median / max over --rounds runs of each.

    python benchmarks/ab_norm_rotary.py --output benchmarks/results/norm_rotary_ab.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from markdown_report import emit  # noqa: E402

from cpu_kernels import dispatch  # noqa: E402
from moelight import LLM, SamplingParams  # noqa: E402

KERNELS = {"rotary": dispatch.rotary, "rms_norm": dispatch.rms_norm}


def use_kernels(on: bool) -> None:
    for name, fn in KERNELS.items():
        setattr(dispatch, name, fn if on else (lambda *a: None))


def measure(quantize: str, batch: int, rounds: int) -> dict[str, list[float]]:
    llm = LLM("bench-1b", load_format="dummy", quantize=quantize)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts = [[5 + (i * 7 + k) % 200 for i in range(60 + k)] for k in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm: weights touched, kernels loaded
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            use_kernels(mode == "on")
            llm.generate(prompts, params, use_tqdm=False)
            rates[mode].append(llm.last_report.decode_tokens_per_s)
    use_kernels(True)
    llm.close()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["none", "int4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"`python benchmarks/ab_norm_rotary.py` at {commit}; {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, kernels {dispatch.kernel_backend()}; "
             f"bench-1b, {args.rounds} runs each, alternated.", "",
             "| experts | batch | decode tok/s with the kernels (min / median / max) | without | median ratio |",
             "|---|---|---|---|---|"]
    for fmt in args.formats:
        for batch in args.batches:
            r = measure(fmt, batch, args.rounds)
            on, off = statistics.median(r["on"]), statistics.median(r["off"])
            show = lambda v: f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"  # noqa: E731
            lines.append(f"| {'bf16' if fmt == 'none' else fmt} | {batch} | {show(r['on'])} | {show(r['off'])} | "
                         f"{on / off:.3f} |")
            print(lines[-1], flush=True)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
