"""HRM prediction against the engine on this machine, at the policy the planner picks.

Model: preset `bench-1b` (dummy weights, bfloat16). Three workloads scaled to a small
CPU host (DESIGN.md section 4's, same prompt/generation shapes, fewer requests):
MT-Bench-like (prompt mean 77 / max 418, gen 64), reasoning-like (mean 242 / max 256,
gen 50) and summarization-like (mean 1693 / max 1984, gen 64). Prompts are synthetic
token lists with those length statistics. For each: plan with the profiled hardware
spec (timed), cap N to the requests, predict the job (optimizer.predict_job), run the
engine exactly as `moelight run` does (packed weights, ignore EOS), compare prefill,
decode and end-to-end tok/s (DESIGN.md section 9). `--diagnose` also times one decode
layer's parts at the planned micro-batch next to their HRM terms.

    python benchmarks/bench_plan_vs_measured.py --output benchmarks/results/plan_vs_measured.md

(--reprofile takes a fresh `moelight profile` first and caches it; --hardware PATH uses a
saved profile instead; without either the cached profile is used, or one is taken;
--scale 0.1 for a quick smoke run; --threads N profiles and runs with N threads;
--diagnose times decode layer parts vs their HRM terms.)
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_kernels import kernel_backend  # noqa: E402
from hrm import DEFAULT_PROFILE_PATH, HardwareSpec, WorkloadSpec, get_hardware, model_from_hf_config  # noqa: E402
from moelight.engine.generation import Engine, GenerationStats  # noqa: E402
from moelight.loading.presets import preset_config  # noqa: E402
from moelight.loading.weights import build_model  # noqa: E402
from moelight.runtime.cpu_linear import pack_model  # noqa: E402
from moelight.sampling.params import SamplingParams  # noqa: E402
from optimizer import fit_policy, plan, predict_job  # noqa: E402
from workloads import synthetic_lengths  # noqa: E402

MODEL, DTYPE = "bench-1b", "bfloat16"


@dataclass(frozen=True)
class Workload:
    name: str
    mean: float
    max_len: int
    gen: int
    requests: int
    min_len: int = 8


WORKLOADS = (
    Workload("mtbench", 77, 418, 64, 256),
    Workload("reasoning", 242, 256, 50, 128, min_len=200),
    Workload("summarization", 1693, 1984, 64, 24, min_len=1200),
)


def token_prompts(w: Workload, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = synthetic_lengths(n, w.mean, w.max_len, seed, min_len=min(w.min_len, int(w.mean)))
    return [[1] + [rng.randrange(3, vocab) for _ in range(max(1, n_tok - 1))] for n_tok in lengths]


def load_hardware(arg: str | None, reprofile: bool = False,
                  threads: int | None = None) -> tuple[HardwareSpec, str]:
    if arg:
        return get_hardware(arg), arg
    if threads:  # the cached profile is for the default thread count: measure this configuration
        from moelight.profiling.machine_profile import profile_machine

        print(f"profiling this machine with {threads} thread(s) ...", flush=True)
        return profile_machine(), f"profiled in-process with {threads} thread(s)"
    path = DEFAULT_PROFILE_PATH.expanduser()
    if reprofile or not path.is_file():
        from moelight.profiling.machine_profile import profile_machine

        print("profiling this machine (as `moelight profile`) ...", flush=True)
        profile_machine().save(path)
    return HardwareSpec.load(path), str(path)


class TimedExecutor:
    """The engine's executor with each decode step timed: its median and fastest step are
    robust to other processes in a way the job's total time is not."""

    def __init__(self, inner) -> None:
        self.inner, self.steps = inner, []

    def prefill(self, *a):
        return self.inner.prefill(*a)

    def decode(self, cache, micro_batches):
        t0 = time.perf_counter()
        out = self.inner.decode(cache, micro_batches)
        self.steps.append((sum(len(mb[0]) for mb in micro_batches), time.perf_counter() - t0))
        return out


def run_one(engine: Engine, hw: HardwareSpec, mspec, w: Workload, n: int, vocab: int) -> dict:
    prompts = token_prompts(w, n, vocab)
    lens = [len(p) for p in prompts]
    wl = WorkloadSpec(sum(lens) / len(lens), w.gen, max(lens))
    t0 = time.perf_counter()
    res = plan(hw, mspec, wl, DTYPE)
    plan_s = time.perf_counter() - t0
    pol = fit_policy(res.policy, n)
    pred = predict_job(hw, mspec, wl, pol, n)
    params = [SamplingParams(max_tokens=w.gen, temperature=0.0, ignore_eos=True)] * n
    stats = GenerationStats()
    engine.executor.steps = []
    engine.generate(prompts, params, [0] * n, pol.batch_size, pol.micro_batch_size, stats=stats)
    full = [t for rows, t in engine.executor.steps if rows == pol.batch_size]  # steps of a full batch
    meas = {
        "prefill_tokens_per_s": stats.prefill_computed_tokens / stats.prefill_seconds,  # as the report's
        "decode_tokens_per_s": stats.decode_tokens / stats.decode_seconds,
        "end_to_end_tokens_per_s": stats.generated_tokens / stats.wall_seconds,
    }
    return {"workload": w, "n": n, "wl": wl, "policy": pol, "plan_s": plan_s, "pred": pred, "meas": meas,
            "wall_s": stats.wall_seconds, "step_pred": res_step(hw, mspec, wl, pol),
            "step_median": statistics.median(full) if full else float("nan"),
            "step_min": min(full) if full else float("nan")}


def res_step(hw: HardwareSpec, mspec, wl: WorkloadSpec, pol) -> float:
    """HRM seconds of one decode step of a full batch at the policy."""
    from optimizer import evaluate_policy

    return evaluate_policy(hw, mspec, wl, pol).decode_step_time


def diagnose(model, hw: HardwareSpec, mspec, mu: int, context: int) -> list[tuple[str, float, float]]:
    """Measured vs HRM seconds of one decode layer's parts and the LM head at micro-batch mu."""
    from cpu_kernels import decode_attention
    from hrm import costs
    from moelight.runtime.kv_cache import RaggedKVCache

    cfg = model.config
    cache = RaggedKVCache.allocate(cfg, [context + 1] * mu, model.embed_tokens.weight.dtype)
    offsets = cache.offsets.clone()
    pos = torch.full((mu,), context, dtype=torch.int64)
    layer = model.layers[0]
    x = model.embed_tokens(torch.randint(3, cfg.vocab_size, (mu,)))
    cos, sin = model.rotary(pos, x.dtype)
    scale = cfg.head_dim**-0.5

    def best(fn, r=5):
        fn()
        out = float("inf")
        for _ in range(r):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out

    with torch.inference_mode():
        q, k, v = layer.pre_attention(x, cos, sin)
        attn = decode_attention(q, cache.k[0], cache.v[0], offsets, pos + 1, scale).flatten(1)
        t_pre = best(lambda: layer.pre_attention(x, cos, sin))
        t_att = best(lambda: decode_attention(q, cache.k[0], cache.v[0], offsets, pos + 1, scale))
        t_post = best(lambda: layer.post_attention(x, attn))
        t_head = best(lambda: model.logits(x))
    oh = costs.layer_overhead_time(hw, 1, "cpu")
    return [
        ("pre-attention (norm, QKV, rotary)", t_pre, costs.pre_attention_time(hw, mspec, mu, "cpu", DTYPE)),
        ("decode attention", t_att, costs.attention_time(hw, mspec, mu, context, "cpu", DTYPE)),
        ("post-attention (O, router, MoE FFN)", t_post,
         costs.post_attention_time(hw, mspec, mu, "cpu", DTYPE)),
        ("dispatch overhead per layer pass (HRM adds it; in measured)", float("nan"), oh),
        ("LM head (+ norm)", t_head, costs.lm_head_time(hw, mspec, mu, "cpu", DTYPE)),
    ]


def _err(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default=None, help="profile JSON or preset (default: the cached profile)")
    ap.add_argument("--reprofile", action="store_true", help="take a fresh full profile first (and cache it)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for the profile and the runs (default: torch's)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each workload's requests")
    ap.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS))
    ap.add_argument("--diagnose", action="store_true", help="time decode layer parts vs HRM")
    ap.add_argument("--output", type=Path, default=None, help="write the markdown table here")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    hw, hw_src = load_hardware(args.hardware, args.reprofile, args.threads)
    cfg = preset_config(MODEL)
    mspec = model_from_hf_config(cfg.to_hf_dict(), name=MODEL)
    model = build_model(cfg, getattr(torch, DTYPE), None, 0)
    pack_model(model)
    engine = Engine(model, ())
    engine.executor = TimedExecutor(engine.executor)
    chosen = [w for w in WORKLOADS if w.name in args.workloads.split(",")]
    # warm-up: oneDNN primitive creation and first-touch allocations are not what we model
    warm = Workload("warmup", 64, 128, 4, 8)
    engine.generate(token_prompts(warm, 8, cfg.vocab_size),
                    [SamplingParams(max_tokens=4, ignore_eos=True)] * 8, [0] * 8, 8, 8)
    rows = []
    for w in chosen:
        n = max(2, round(w.requests * args.scale))
        r = run_one(engine, hw, mspec, w, n, cfg.vocab_size)
        rows.append(r)
        p, m = r["pred"], r["meas"]
        print(f"{w.name:14s} N={r['policy'].batch_size:4d} mu={r['policy'].micro_batch_size:4d} "
              f"plan {r['plan_s'] * 1e3:5.0f} ms | prefill {p['prefill_tokens_per_s']:7.1f} / "
              f"{m['prefill_tokens_per_s']:7.1f} | decode {p['decode_tokens_per_s']:7.1f} / "
              f"{m['decode_tokens_per_s']:7.1f} | e2e {p['end_to_end_tokens_per_s']:7.1f} / "
              f"{m['end_to_end_tokens_per_s']:7.1f} "
              f"({_err(p['end_to_end_tokens_per_s'], m['end_to_end_tokens_per_s'])}) | {r['wall_s']:.1f} s | "
              f"step {r['step_pred'] * 1e3:.0f} / median {r['step_median'] * 1e3:.0f} / "
              f"min {r['step_min'] * 1e3:.0f} ms", flush=True)
    diag = []
    if args.diagnose:
        for r in rows:
            mu, ctx = r["policy"].micro_batch_size, int(r["wl"].mean_context)
            diag.append((r["workload"].name, mu, ctx, diagnose(model, hw, mspec, mu, ctx)))
            for name, meas, pred in diag[-1][3]:
                print(f"  {r['workload'].name} mu={mu} ctx={ctx}: {name:40s} measured {meas * 1e3:8.2f} ms  "
                      f"HRM {pred * 1e3:8.2f} ms")
    if args.output:
        write_markdown(args, rows, diag, hw, hw_src)


def write_markdown(args, rows, diag, hw: HardwareSpec, hw_src: str) -> None:
    c = hw.cpu
    cmd = "python benchmarks/bench_plan_vs_measured.py " + " ".join(sys.argv[1:])
    lines = [
        "# HRM prediction vs measured engine throughput (this machine)", "",
        f"Command: `{cmd}`", "",
        f"Host: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, attention kernels {kernel_backend()}. "
        f"Model `{MODEL}` (dummy weights, {DTYPE}).",
        f"Hardware spec: `{hw_src}` — read {c.bandwidth / 1e9:.1f} GB/s, bf16 GEMM "
        + ", ".join(f"M={m:g}: {f / 1e9:.0f}" for m, f in c.gemm_flops.get("bfloat16", []))
        + f" GFLOP/s, decode attention {c.attention_bandwidth / 1e9:.1f} GB/s, overhead "
        f"{c.layer_overhead_s * 1e3:.2f} ms/layer pass + {c.step_overhead_s * 1e3:.2f} ms/step.", "",
        "tok/s as DESIGN.md §9: prefill = prompt tokens / prefill time, "
        "decode = decode tokens / decode time, "
        "end-to-end = generated tokens / wall time. Predicted = HRM (optimizer.predict_job) at the planned "
        "policy, N capped at the request count.", "",
        "| workload | requests | prompt mean/max | gen | N | μ | plan ms | prefill pred/meas "
        "| decode pred/meas "
        "| e2e pred/meas | e2e error | wall s | decode step ms pred / median / min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w, p, m, pol = r["workload"], r["pred"], r["meas"], r["policy"]
        lines.append(
            f"| {w.name} | {r['n']} | {r['wl'].prompt_len:.0f}/{r['wl'].max_prompt_len} | {w.gen} "
            f"| {pol.batch_size} | {pol.micro_batch_size} | {r['plan_s'] * 1e3:.0f} "
            f"| {p['prefill_tokens_per_s']:.0f} / {m['prefill_tokens_per_s']:.0f} "
            f"| {p['decode_tokens_per_s']:.0f} / {m['decode_tokens_per_s']:.0f} "
            f"| {p['end_to_end_tokens_per_s']:.1f} / {m['end_to_end_tokens_per_s']:.1f} "
            f"| {_err(p['end_to_end_tokens_per_s'], m['end_to_end_tokens_per_s'])} | {r['wall_s']:.1f} "
            f"| {r['step_pred'] * 1e3:.0f} / {r['step_median'] * 1e3:.0f} / {r['step_min'] * 1e3:.0f} |")
    for name, mu, ctx, parts in diag:
        lines += ["", f"Decode layer parts, {name} (μ={mu}, context {ctx}): measured vs HRM, ms", "",
                  "| part | measured | HRM |", "|---|---|---|"]
        lines += [f"| {n} | {a * 1e3:.2f} | {b * 1e3:.2f} |" for n, a, b in parts]
    load = os.getloadavg()
    lines += ["", f"Load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
              f"{os.cpu_count()} CPUs" + (" — other processes competed for the CPU: measured numbers are "
                                           "pessimistic" if load[0] > 1.5 * torch.get_num_threads() else "")]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    old = args.output.read_text() if args.output.exists() else ""
    marker = "\n## Model notes"
    notes = old[old.index(marker):] if marker in old else ""
    args.output.write_text("\n".join(lines) + "\n" + notes)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
