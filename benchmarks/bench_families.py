"""The README's main job on bench-1b's size in four families' shapes, and what limits each.

Presets (hrm/model_presets.py, dummy bf16 weights, ~0.79 B parameters each, 8 layers, hidden
1024, 16 heads / 4 KV heads of 64):
- bench-1b: Mixtral's shape, 8 experts of width 3584, top-2;
- bench-qwen3-moe: Qwen3-MoE's many small experts, 128 of width 224, top-8, q/k norms;
- bench-gpt-oss: GPT-OSS's shape, 32 experts of width 896, top-4, biases, clamped SwiGLU,
  attention sinks, sliding window 128 on every other layer, YaRN rotary;
- bench-deepseek: DeepSeek-V2-Lite's shape, multi-head latent attention (16 heads over a latent of
  512 + a RoPE key of 64: the latent KV cache, absorbed decode through cpu_kernels' latent kernel),
  64 experts of width 448 top-6, two shared experts, the first layer dense.

Each runs the README job through `LLM` (the CLI's job path: plan, memory check, load,
generate): 256 requests from workloads/examples/prompts.jsonl, 64 new tokens, EOS ignored.
Then one decode step's layer parts are timed at the job's shape (micro-batch of 256 at
context 100): pre-attention, attention, post-attention (O projection + MoE block), and the
MoE block's grouped expert matmuls are timed two ways: the engine's loop (one oneDNN-packed
matmul per expert) and torch._grouped_mm over all experts at once (no Python loop).

    python benchmarks/bench_families.py --output benchmarks/results/families.md
    python benchmarks/bench_families.py --presets bench-1b bench-deepseek --runs 3   # DeepSeek beside Mixtral
    python benchmarks/bench_families.py --presets bench-deepseek --num-requests 16 --gen-len 8   # a quick check
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.models.moe import expert_mix  # noqa: E402
from moelight.runtime.forward import attention_extras  # noqa: E402
from moelight.runtime.latent_kv_cache import kv_cache_class  # noqa: E402

PRESETS = ("bench-1b", "bench-qwen3-moe", "bench-gpt-oss", "bench-deepseek")


def best(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def prompts(n: int) -> list[str]:
    lines = [json.loads(x)["prompt"] for x in (ROOT / "workloads/examples/prompts.jsonl").read_text().splitlines()]
    return [lines[i % len(lines)] for i in range(n)]


@torch.inference_mode()
def layer_parts(llm: LLM, batch: int, context: int) -> dict[str, float]:
    """Seconds per decode layer pass of `batch` sequences at `context`, by part (layer 1: a GPT-OSS
    full-attention layer; layer 0 is its sliding one and is timed for attention too)."""
    model, cfg = llm.model, llm.config
    dtype = model.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(batch, cfg.hidden_size, generator=g) * 0.5).to(dtype)
    pos = torch.full((batch,), context - 1, dtype=torch.int64)
    cos, sin = model.rotary(pos, dtype)
    cache = kv_cache_class(cfg).allocate(cfg, [context + 8] * batch, dtype)
    for li in range(cfg.num_layers):
        for t in cache.layer(li):
            t.normal_(generator=g)

    layer = model.layers[1]
    q, _ = layer.attention_inputs(x, cos, sin, decode=True)
    lengths = pos + 1

    def attend(li: int):
        extras = attention_extras(model, li)
        return cache.attend(li, q, cache.offsets, lengths, cfg.attention_scale, **extras).flatten(1)

    attn = attend(1)
    h = layer.post_attention_layernorm(x)
    moe = layer.mlp
    parts = {
        "pre-attention": best(lambda: layer.attention_inputs(x, cos, sin, decode=True)),
        "attention (full)": best(lambda: attend(1)),
        "attention (layer 0)": best(lambda: attend(0)),
        "post-attention": best(lambda: layer.post_attention(x, layer.decode_output(attn))),
        "MoE block": best(lambda: moe(h)),
    }
    if hasattr(moe, "gate_up_proj") and not isinstance(moe.gate_up_proj, list):
        return parts
    # the grouped expert matmuls alone: the engine's loop against one grouped GEMM over all experts
    raw = getattr(llm, "_dense_experts", None)
    if raw is not None and cfg.model_type != "gpt_oss":
        gu, dn = raw
        weights, experts = moe.route(h)
        parts["experts: loop (engine)"] = best(lambda: expert_mix(h, weights, experts, moe.gate_up_proj,
                                                                  moe.down_proj, moe.linear))
        parts["experts: torch._grouped_mm"] = best(lambda: grouped_mm_experts(h, weights, experts, gu, dn))
    return parts


def grouped_mm_experts(x, weights, experts, gate_up, down):
    """The loop-free alternative: token-expert pairs sorted by expert, one grouped GEMM per matrix."""
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    offs = torch.cumsum(torch.bincount(flat, minlength=gate_up.shape[0]), 0).to(torch.int32)
    gu = torch._grouped_mm(x.index_select(0, token), gate_up.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)
    out = torch.zeros_like(x)
    out.index_add_(0, token, (y * weights.reshape(-1, 1).index_select(0, order)).to(x.dtype))
    return out


def run_preset(name: str, n: int, gen: int) -> dict:
    from moelight.loading.weights import build_model

    llm = LLM(name, load_format="dummy", dtype="bfloat16")
    cfg = llm.config
    if cfg.model_type != "gpt_oss":  # dense copies of layer 1's experts for the grouped-GEMM comparison
        dense = build_model(cfg, torch.bfloat16, None, 0).layers[1].mlp
        llm._dense_experts = (dense.gate_up_proj.detach(), dense.down_proj.detach())
    t0 = time.perf_counter()
    llm.generate(prompts(n), SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    rep = llm.last_report
    return {"preset": name, "experts": f"{cfg.num_experts} x {cfg.intermediate_size}, top-{cfg.top_k}",
            "batch": rep.batch_size, "micro": rep.micro_batch_size, "e2e": rep.end_to_end_tokens_per_s,
            "prefill": rep.prefill_tokens_per_s, "decode": rep.decode_tokens_per_s,
            "hrm": rep.prediction.get("end_to_end_tokens_per_s", 0.0), "wall": wall,
            "parts": layer_parts(llm, min(rep.micro_batch_size, n), 100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=1, help="repeat the jobs, report min/median/max")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS, help="which jobs to run")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    rows: dict[str, list[dict]] = {p: [] for p in args.presets}
    for _ in range(args.runs):
        for p in args.presets:
            r = run_preset(p, args.num_requests, args.gen_len)
            rows[p].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "parts"}), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    lines = [f"# Families on the README job ({args.num_requests} requests, gen {args.gen_len}, bf16)", "",
             f"`python benchmarks/bench_families.py --runs {args.runs} --presets {' '.join(args.presets)}` at "
             f"{commit}, {cpu}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.python_version()}", "",
             "| preset | experts | N / micro | e2e tok/s (min / median / max) | prefill tok/s | decode tok/s | "
             "HRM e2e |", "|---|---|---|---|---|---|---|"]
    for p, rs in rows.items():
        e2e = sorted(r["e2e"] for r in rs)

        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        lines.append(f"| {p} | {rs[0]['experts']} | {rs[0]['batch']} / {rs[0]['micro']} | "
                     f"{e2e[0]:.1f} / {statistics.median(e2e):.1f} / {e2e[-1]:.1f} | {med('prefill'):.0f} | "
                     f"{med('decode'):.0f} | {med('hrm'):.1f} |")
    lines += ["", "Decode layer parts (ms per layer pass, micro-batch at context 100, best of 5, last run):", "",
              "| preset | " + " | ".join(rows[args.presets[0]][-1]["parts"]) + " |",
              "|---|" + "---|" * len(rows[args.presets[0]][-1]["parts"])]
    for p, rs in rows.items():
        parts = rs[-1]["parts"]
        cells = [f"{parts[k] * 1e3:.2f}" if k in parts else "–" for k in rows[args.presets[0]][-1]["parts"]]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    extra = sorted({k for rs in rows.values() for k in rs[-1]["parts"]} - set(rows[args.presets[0]][-1]["parts"]))
    for k in extra:
        lines.append("")
        lines.append(f"{k}: " + ", ".join(f"{p} {rs[-1]['parts'][k] * 1e3:.2f} ms" for p, rs in rows.items()
                                          if k in rs[-1]["parts"]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
