"""Static batches against refilled (rolling) batches on answers of mixed length.

Real answers end at EOS after very different lengths; a static batch then runs until its
longest answer ends while the finished slots idle. Dummy weights never say EOS, so the
answer lengths are drawn per request (max_tokens, EOS ignored) from a spread like
MT-Bench answers: log-uniform between --min-gen and --max-gen. Same model, prompts,
lengths, N and micro-batch for both runs. Tokens are compared: in float32 they match; in
bfloat16 a different batch mix changes the matmul shapes, hence the rounding, which can
flip a near-tied greedy choice (as in any batched engine), so some sequences differ.

    python benchmarks/bench_refill.py --output benchmarks/results/refill.md
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moelight.engine.generation import Engine, GenerationStats  # noqa: E402
from moelight.loading.presets import preset_config  # noqa: E402
from moelight.loading.weights import build_model  # noqa: E402
from moelight.runtime.cpu_linear import pack_model  # noqa: E402
from moelight.sampling.params import SamplingParams  # noqa: E402
from workloads import mtbench_like_lengths  # noqa: E402


def answer_lengths(n: int, lo: int, hi: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-1b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=128)
    ap.add_argument("--min-gen", type=int, default=8)
    ap.add_argument("--max-gen", type=int, default=256)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    cfg = preset_config(args.model)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, cfg.vocab_size) for _ in range(max(1, n - 1))]
               for n in mtbench_like_lengths(args.num_prompts, seed=0)]
    gens = answer_lengths(args.num_prompts, args.min_gen, args.max_gen)
    params = [SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True) for g in gens]
    model = build_model(cfg, getattr(torch, args.dtype), None, seed=0)
    pack_model(model)
    rows, tokens = [], {}
    for refill in (False, True):
        engine = Engine(model, (2,), refill=refill)
        engine.generate(prompts[:8], params[:8], list(range(8)), 8, 8)  # warm-up (oneDNN primitives)
        stats = GenerationStats()
        res = engine.generate(prompts, params, list(range(len(prompts))), args.batch_size,
                              args.micro_batch_size, stats=stats)
        tokens[refill] = [r.token_ids for r in res]
        name = "refill" if refill else "static"
        steps = sum(b["decode_steps"] for b in stats.batches)
        rows.append((name, stats.generated_tokens / stats.wall_seconds, stats.decode_tokens / stats.decode_seconds,
                     steps, len(stats.batches), stats.wall_seconds))
        print(f"{name}: {rows[-1][1]:.1f} tok/s e2e, {steps} decode steps, {rows[-1][5]:.1f} s", flush=True)
    same = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True))
    lines = [
        "# Static vs refilled batches (mixed answer lengths)", "",
        "Command: `python " + " ".join(sys.argv) + "`", "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}. "
        f"Model {args.model} ({args.dtype}, dummy weights), {args.num_prompts} prompts (MT-Bench-like lengths), "
        f"answer lengths log-uniform in [{args.min_gen}, {args.max_gen}] (mean {sum(gens) / len(gens):.0f}), "
        f"N={args.batch_size}, micro-batch {args.micro_batch_size}, greedy. Sequences with identical tokens in "
        f"both runs: {same}/{len(prompts)}.", "",
        "| batching | e2e tok/s | decode tok/s | decode steps | prefill waves | wall s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {e:.1f} | {d:.1f} | {s} | {w} | {t:.1f} |" for n, e, d, s, w, t in rows]
    lines += ["", f"Refill / static end to end: {rows[1][1] / rows[0][1]:.2f}x"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)


if __name__ == "__main__":
    main()
