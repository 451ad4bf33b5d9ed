"""The first run on a GPU: profile -> plan -> run every schedule and latency mode on a small trained
model, tokens against the plain CPU engine, measured against predicted throughput, one table.

    python benchmarks/gpu_smoke.py                       # on the GPU (profiles it first, ~1 minute)
    python benchmarks/gpu_smoke.py --device emulated     # the same steps on the emulated device (a T4's plan)

Each row is one job through the `LLM` front end (`moelight run`'s path): greedy float32 answers of
`--requests` prompts, compared with the plain CPU engine's (sequences equal / all; on a GPU a token
may flip where two logits are within float32 GEMM rounding), the end-to-end tok/s measured and the
HRM's prediction for the plan it ran, and the runtime's own figures from the run report (host syncs
per decode step from the compute lane, kernel launches per layer pass, peak device memory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runs from a clone without the package installed

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.pipeline.schedule import SCHEDULES  # noqa: E402

CKPT = ROOT / "tests" / "data" / "stdlib-moe"  # trained: routing with structure
SNIPPETS = ["def __init__(self, name, value=None):\n    ", "import os\nimport sys\n\n\ndef main(", "class Error(",
            "    for i in range(len(items)):\n        ", "    \"\"\"Return the number of", "if __name__ == ",
            "    raise ValueError(f\"", "    with open(path) as f:\n        "]


def hardware_for(device: str) -> str:
    """A profile of this machine (its GPU measured) on CUDA; the T4 preset for the emulated device."""
    if device != "cuda":
        return "t4"
    from moelight.profiling.machine_profile import profile_machine

    t0 = time.perf_counter()
    hw = profile_machine(quick=True)
    path = hw.save(Path(tempfile.mkdtemp()) / "profile.json")
    print(f"profiled {hw.gpu.name if hw.gpu else 'no GPU'} in {time.perf_counter() - t0:.0f} s -> {path}")
    return str(path)


def run(model: str, options: dict, prompts: list[str], params: SamplingParams) -> tuple[list, dict]:
    llm = LLM(model, **options)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        report = llm.last_report.to_dict()
    finally:
        llm.close()
    return [o.outputs[0].token_ids for o in outs], report | {"wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "emulated"), default="cuda")
    ap.add_argument("--model", default=str(CKPT))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: pass --device emulated to run the same steps on the emulated device")
    hardware = hardware_for(args.device)
    prompts = [SNIPPETS[i % len(SNIPPETS)] + "x" * (i // len(SNIPPETS)) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    common = {"dtype": "float32", "hardware": hardware}
    ref, _ = run(args.model, common | {"device": "cpu", "gpus": 0}, prompts, params)  # f32 tokens: batching-proof
    modes = [(s, {"schedule": s, "mode": "throughput"}) for s in SCHEDULES] + [("latency", {"mode": "latency"})]
    rows = []
    print(f"\n{args.device}, {Path(args.model).name}, {args.requests} requests x {args.gen_len} tokens, float32\n")
    print("| run | batch / micro | equal to CPU | tok/s measured | tok/s predicted | measured / predicted "
          "| syncs / step | launches / layer pass | peak device memory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, opts in modes:
        tokens, rep = run(args.model, common | {"device": args.device} | opts, prompts, params)
        equal = sum(a == b for a, b in zip(tokens, ref, strict=True))
        measured = rep["end_to_end_tokens_per_s"]
        predicted = rep["prediction"].get("end_to_end_tokens_per_s", 0.0)
        row = {"run": name, "batch": rep["batch_size"], "micro": rep["micro_batch_size"], "equal": equal,
               "requests": len(ref), "measured": measured, "predicted": predicted,
               "syncs": rep["gpu_lane_syncs_per_step"], "launches": rep["launches_per_layer_pass"],
               "peak": rep["runtime"].get("device_memory_peak", 0)}
        rows.append(row)
        ratio = f"{measured / predicted:.2f}" if predicted else "-"
        syncs = "-" if row["syncs"] is None else f"{row['syncs']:.1f}"
        launches = "-" if row["launches"] is None else f"{row['launches']:.0f}"
        print(f"| {name} | {row['batch']} / {row['micro']} | {equal}/{len(ref)} | {measured:.1f} | {predicted:.1f} "
              f"| {ratio} | {syncs} | {launches} | {row['peak'] / 2**20:.0f} MiB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
