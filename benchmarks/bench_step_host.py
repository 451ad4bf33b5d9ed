"""Where a decode step's host time goes: the README job through `LLM` on a device, every thread
sampled (the launcher, each lane's worker, the copy streams), and each thread's busy time split by
the innermost project function on its stack.

A CUDA step that takes far longer than its kernels is host-bound, and cProfile sees only the thread
that starts it; the lanes' work (KV gathers, pinned staging, CPU attention) runs on their own
threads. So a sampler thread reads every thread's Python stack each `--interval` ms
(`sys._current_frames()`): a sample counts as idle when the thread waits (a lock, a queue, an event,
a CUDA synchronize), else it goes to the innermost frame in moelight/ or cpu_kernels/ (torch's own
C++ work shows up under the project function that called it). Shares are of the job's generation
wall time, per thread; `ms / step` divides a row's time by the decode steps.

    python benchmarks/bench_step_host.py --device cuda                      # a GPU: the README job
    python benchmarks/bench_step_host.py --device emulated --requests 64    # the same on the emulator
    python benchmarks/bench_step_host.py --device cpu --requests 64 --gen-len 16
    python benchmarks/bench_step_host.py --device cpu --requests 8 --batch-size 8 --quantize int4
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moelight import LLM, SamplingParams  # noqa: E402

PROMPTS = ROOT / "workloads" / "examples" / "prompts.jsonl"
PROJECT = (str(ROOT / "moelight"), str(ROOT / "cpu_kernels"))
WAITING = {"wait", "acquire", "get", "synchronize", "_wait_for_tstate_lock", "join", "sleep", "select",
           "result", "wait_event"}


def frame_label(frame) -> str:
    """'idle' for a thread that waits, else the innermost project function (file:function)."""
    if frame.f_code.co_name in WAITING:
        return "idle"
    f = frame
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(PROJECT):
            return f"{Path(path).name}:{f.f_code.co_name}"
        f = f.f_back
    return f"(outside) {Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"


class StackSampler:
    """Samples every other thread's innermost frame at a fixed interval, counted by (thread, label)."""

    def __init__(self, interval_s: float) -> None:
        self.interval, self.counts, self.samples = interval_s, Counter(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def _loop(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[(names.get(ident, str(ident)), frame_label(frame))] += 1
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompts(n: int) -> list[str]:
    """The README job's prompts: the example file cycled to n requests."""
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [texts[i % len(texts)] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "emulated", "cpu"), default="cuda")
    ap.add_argument("--model", default="bench-1b", help="a preset or a model folder (its config.json)")
    ap.add_argument("--tokenizer", help="e.g. byte, for a config-only folder with dummy weights")
    ap.add_argument("--mode", default="throughput", choices=("throughput", "latency"))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--hardware", default=None, help="a profile or preset (default: the option's own)")
    ap.add_argument("--batch-size", type=int, help="fix the batch (default: the planner's)")
    ap.add_argument("--quantize", choices=("int8", "int4"), help="quantized experts")
    ap.add_argument("--interval", type=float, default=1.0, help="ms between samples")
    ap.add_argument("--top", type=int, default=8, help="rows per thread")
    ap.add_argument("--json", type=Path, help="also write the counts here")
    args = ap.parse_args()
    options = {"load_format": "dummy", "device": args.device, "mode": args.mode}
    if args.device == "cpu":
        options |= {"gpus": 0, "mode": "throughput"}
    if args.hardware:
        options["hardware"] = args.hardware
    if args.batch_size:
        options["batch_size"] = args.batch_size
    if args.quantize:
        options["quantize"] = args.quantize
    if args.tokenizer:
        options["tokenizer"] = args.tokenizer
    llm = LLM(args.model, **options)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    try:
        with StackSampler(args.interval / 1e3) as sampler:
            t0 = time.perf_counter()
            llm.generate(prompts(args.requests), params)
            wall = time.perf_counter() - t0
        report, step_s = llm.last_report.to_dict(), llm.last_stats.step_seconds
    finally:
        llm.close()
    steps = max(1, len(step_s))
    per_sample = wall / max(1, sampler.samples)
    print(f"{args.model} on {args.device} ({args.mode}), {args.requests} requests x {args.gen_len} tokens: "
          f"{wall:.2f} s generating, {report['end_to_end_tokens_per_s']:.1f} tok/s, step p50 "
          f"{report['tpot_ms'].get('p50', 0.0):.1f} ms, {steps} decode steps ({sum(step_s):.2f} s), "
          f"{sampler.samples} samples\n")
    print("| thread | where | share of wall | ms / step |")
    print("|---|---|---|---|")
    threads = sorted({t for t, _ in sampler.counts})
    for thread in threads:
        rows = sorted(((c, label) for (t, label), c in sampler.counts.items() if t == thread), reverse=True)
        busy = [(c, label) for c, label in rows if label != "idle"]
        if not busy:
            continue
        for c, label in busy[: args.top]:
            print(f"| {thread} | {label} | {c / sampler.samples:.1%} | {c * per_sample / steps * 1e3:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"wall_s": wall, "samples": sampler.samples, "decode_steps": steps,
                                         "counts": [[t, label, c] for (t, label), c in sampler.counts.items()]},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
