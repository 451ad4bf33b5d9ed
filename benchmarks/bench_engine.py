"""moelight against transformers `generate` on the same dummy Mixtral, in one run.

Model: preset `bench-1b` (hidden 1024, intermediate 3584, 8 layers, 8 experts top-2,
16 heads, 4 KV heads, vocab 32000). Prompts: the same token lists for both, lengths
MT-Bench-like (mean 77, max 418). Each engine first picks its best batch size on a
short sweep (a subset of prompts, short generation), then runs the full job at it.
End-to-end tokens/s = generated tokens / wall time (prefill included), DESIGN.md §9.

    python benchmarks/bench_engine.py --output benchmarks/results/engine.md
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_kernels import kernel_backend  # noqa: E402
from moelight.engine.generation import Engine, GenerationStats  # noqa: E402
from moelight.loading.presets import preset_config  # noqa: E402
from moelight.loading.weights import build_model  # noqa: E402
from moelight.runtime.cpu_linear import pack_model  # noqa: E402
from moelight.sampling.params import SamplingParams  # noqa: E402
from workloads import mtbench_like_lengths  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(max(1, length - 1))]
            for length in mtbench_like_lengths(n, seed=seed)]


def hf_model_from(ours_state: dict, cfg, dtype):
    """transformers' MixtralForCausalLM holding exactly our dummy weights (our state dict)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    hf_cfg = MixtralConfig(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf = MixtralForCausalLM(hf_cfg)
    state = {}
    for name, t in ours_state.items():
        for packed in ("gate_up_proj", "down_proj"):
            name = name.replace(f"mlp.{packed}", f"mlp.experts.{packed}")
        state[name if name.startswith("lm_head") else "model." + name] = t
    hf.load_state_dict(state, strict=True)
    return hf.to(dtype).eval()


def run_hf(hf, prompts, gen_len, batch_size) -> tuple[float, int]:
    t0 = time.perf_counter()
    generated = 0
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s : s + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len,
                              do_sample=False, pad_token_id=0)
        generated += (out.shape[1] - width) * len(batch)
    return time.perf_counter() - t0, generated


def run_ours(engine, prompts, gen_len, batch_size) -> GenerationStats:
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    stats = GenerationStats()
    engine.generate(prompts, [params] * len(prompts), list(range(len(prompts))), batch_size, batch_size, stats=stats)
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="32,64,128,256", help="moelight's sweep")
    ap.add_argument("--hf-batch-sizes", default="16,32,64",
                    help="transformers' sweep (its padded eager attention runs out of 24 GiB at 256)")
    ap.add_argument("--hf-sweep-prompts", type=int, default=64)
    ap.add_argument("--sweep-prompts", type=int, default=64)
    ap.add_argument("--sweep-gen", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = preset_config("bench-1b")
    prompts = make_prompts(args.num_prompts, cfg.vocab_size)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        ours = build_model(cfg, dtype, None, seed=0)
        dense = None if args.skip_hf else {k: v.clone() for k, v in ours.state_dict().items()}
        pack_model(ours)
        engine = Engine(ours, (2,))
        sweep = prompts[: args.sweep_prompts]
        ours_sweep = {b: run_ours(engine, sweep, args.sweep_gen, b) for b in sizes if b <= len(sweep) or b == sizes[0]}
        best_ours = max(ours_sweep, key=lambda b: ours_sweep[b].generated_tokens / ours_sweep[b].wall_seconds)
        st = run_ours(engine, prompts, args.gen_len, best_ours)
        ours_tps = st.generated_tokens / st.wall_seconds
        row = {"dtype": dname, "ours_batch": best_ours, "ours_tps": ours_tps,
               "ours_prefill": st.prompt_tokens / st.prefill_seconds,
               "ours_decode": st.decode_tokens / st.decode_seconds, "ours_wall": st.wall_seconds}
        del engine, ours  # transformers runs alone, after ours, on the same weights
        hf = None if dense is None else hf_model_from(dense, cfg, dtype)
        print(f"[{dname}] moelight sweep " + ", ".join(
            f"b={b}: {s.generated_tokens / s.wall_seconds:.1f}" for b, s in ours_sweep.items()), flush=True)
        print(f"[{dname}] moelight b={best_ours}: {ours_tps:.1f} tok/s e2e", flush=True)
        if hf is not None:
            hf_sweep = {}
            for b in (int(x) for x in args.hf_batch_sizes.split(",")):
                secs, n = run_hf(hf, prompts[: args.hf_sweep_prompts], args.sweep_gen, b)
                hf_sweep[b] = n / secs
            best_hf = max(hf_sweep, key=hf_sweep.get)
            secs, n = run_hf(hf, prompts, args.gen_len, best_hf)
            row.update(hf_batch=best_hf, hf_tps=n / secs, hf_wall=secs)
            print(f"[{dname}] transformers sweep " + ", ".join(f"b={b}: {v:.1f}" for b, v in hf_sweep.items()))
            print(f"[{dname}] transformers b={best_hf}: {n / secs:.1f} tok/s e2e", flush=True)
        rows.append(row)
        del hf, dense
    table = render(rows, args)
    print(table)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(table + "\n")


def render(rows, args) -> str:
    cmd = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
    lines = [
        f"Command: `{cmd}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, attention backend {kernel_backend()}. Model bench-1b (dummy weights), "
        f"{args.num_prompts} prompts (MT-Bench-like lengths, mean 77), gen-len {args.gen_len}, greedy, EOS ignored.",
        "",
        "| dtype | moelight batch | moelight tok/s (e2e) | prefill tok/s | decode tok/s | transformers batch "
        "| transformers tok/s (e2e) | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hf = r.get("hf_tps")
        ratio = f"{r['ours_tps'] / hf:.2f}x" if hf else "-"
        lines.append(
            f"| {r['dtype']} | {r['ours_batch']} | {r['ours_tps']:.1f} | {r['ours_prefill']:.0f} "
            f"| {r['ours_decode']:.0f} "
            f"| {r.get('hf_batch', '-')} | {f'{hf:.1f}' if hf else '-'} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
