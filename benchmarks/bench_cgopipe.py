"""CGOPipe against the three comparison schedules (paper Fig. 6), simulated and measured.

(a) HRM simulation of one batch (prefill + decode) of Mixtral 8x7B on S1 (T4) and S2 (L4),
    MT-Bench shape (prompt 77, gen 128), for every schedule at two policies: the
    planner's CGOPipe policy and the planner's FlexGen-style policy (attention on GPU).
(b) Wall-clock on the emulated accelerator (this machine's CPU plus a slow link and a
    bounded arena): a small random model, all schedules, same tokens as the plain engine.

    python benchmarks/bench_cgopipe.py [--quick] [--link-gbps 1.0]
"""

from __future__ import annotations

import argparse
import random

import torch

from hrm import WorkloadSpec, get_hardware, get_model
from moelight.engine.generation import Engine, GenerationStats
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig
from moelight.pipeline.gantt import draw_gantt, timeline_from_events
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.pipeline.schedule_simulator import simulate_policy
from moelight.sampling.params import SamplingParams
from optimizer import plan


def simulated(dtype: str) -> None:
    m = get_model("mixtral-8x7b")
    best: dict[tuple[str, bool, str], float] = {}  # (setting, padded, system) -> e2e tok/s
    for padded in (False, True):
        work = WorkloadSpec(77, 128, max_prompt_len=418, padded=padded)
        print(
            f"\n### (a) simulated, Mixtral 8x7B, prompt {'418 (padded)' if padded else '77'}, "
            f"gen 128, {dtype}\n"
        )
        print(
            "| setting | policy | N = mu x n | r_w | "
            + " | ".join(SCHEDULES)
            + " | cgopipe / flexgen@its policy |"
        )
        print("|---|---|---|---|" + "---|" * len(SCHEDULES) + "---|")
        for hw_name in ("s1", "s2"):
            hw = get_hardware(hw_name)
            fg = None
            rows = []
            for family in ("cgopipe", "flexgen"):
                pol = plan(hw, m, work, dtype=dtype, family=family).policy
                res = {s: simulate_policy(hw, m, work, pol, s) for s in SCHEDULES}
                rows.append((family, pol, res))
                if family == "flexgen":
                    fg = res["flexgen"].e2e_tok_s
                    best[(hw_name, padded, "flexgen")] = fg
                else:
                    best[(hw_name, padded, "cgopipe")] = res["cgopipe"].e2e_tok_s
            for family, pol, res in rows:
                cells = " | ".join(f"{res[s].e2e_tok_s:.1f}" for s in SCHEDULES)
                ratio = res["cgopipe"].e2e_tok_s / fg
                print(
                    f"| {hw_name.upper()} | {family} | {pol.batch_size} = {pol.micro_batch_size} x "
                    f"{pol.num_micro_batches} | {pol.r_w:.3f} | {cells} | {ratio:.2f}x |"
                )
        print(
            "\nend-to-end tok/s (prefill included); per-layer decode time and lane utilisation of the "
            "planner policy:"
        )
        for hw_name in ("s1", "s2"):
            hw = get_hardware(hw_name)
            pol = plan(hw, m, work, dtype=dtype, family="cgopipe").policy
            for s in SCHEDULES:
                print(f"    {hw_name.upper()} {simulate_policy(hw, m, work, pol, s).summary()}")
    print("\nsystem-level ratios (each system at its own planned policy, like the paper's Fig. 7):")
    for hw_name in ("s1", "s2"):
        padded_ratio = best[(hw_name, True, "cgopipe")] / best[(hw_name, True, "flexgen")]
        ragged_ratio = best[(hw_name, False, "cgopipe")] / best[(hw_name, True, "flexgen")]
        print(
            f"    {hw_name.upper()}: CGOPipe vs FlexGen, both padded to 418: {padded_ratio:.2f}x; "
            f"CGOPipe unpadded (mean 77) vs FlexGen padded: {ragged_ratio:.2f}x"
        )


def emulated(link_gbps: float, quick: bool, slowdown: float, gantt: str | None) -> None:
    cfg = ModelConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        num_experts=8,
        top_k=2,
        head_dim=64,
        max_position_embeddings=1024,
    )
    model = build_model(cfg, torch.float32, None, seed=0)
    rng = random.Random(0)
    n_seq, mu, gen = (16, 4, 4) if quick else (48, 12, 12)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(48, 80))] for _ in range(n_seq)]
    params = [SamplingParams(max_tokens=gen, ignore_eos=True) for _ in prompts]
    r_w = 0.25
    print(
        f"\n### (b) emulated device: {cfg.num_layers} layers, h={cfg.hidden_size}, "
        f"f={cfg.intermediate_size}, "
        f"E={cfg.num_experts}, float32; {n_seq} sequences, mu={mu} ({n_seq // mu} micro-batches), "
        f"gen {gen}, r_w={r_w}; link {link_gbps} GB/s per direction; GPU-lane slowdown {slowdown}x\n"
    )
    stats = GenerationStats()
    ref = Engine(model, (2,), max_prefill_tokens=1024).generate(
        prompts, params, [0] * n_seq, n_seq, mu, stats=stats
    )
    ref_tokens = [r.token_ids for r in ref]
    print(
        "| schedule | decode s | decode tok/s | vs flexgen-cpu | same tokens | peak / budget MiB "
        "| last step: lane busy |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for s in ("flexgen-cpu", "overlap-unpaged", "flexgen", "cgopipe"):
        ex = PipelineExecutor(
            model,
            s,
            "emulated",
            r_w=r_w,
            max_prefill_tokens=1024,
            max_prompt_len=80,
            max_batch=mu,
            max_context=80 + gen,
            h2d_bandwidth=link_gbps * 1e9,
            d2h_bandwidth=link_gbps * 1e9,
            compute_slowdown=slowdown,
        )
        st = GenerationStats()
        out = Engine(model, (2,), max_prefill_tokens=1024, executor=ex).generate(
            prompts, params, [0] * n_seq, n_seq, mu, stats=st
        )
        same = [r.token_ids for r in out] == ref_tokens
        measured = timeline_from_events(*ex.last_pass)  # the last decode step, as it ran
        rows[s] = (st, same, ex.device.memory_peak, ex.device.memory_capacity, measured)
        ex.close()
    base = rows["flexgen-cpu"][0]
    for s, (st, same, peak, cap, tl) in rows.items():
        util = ", ".join(f"{k} {v:.0%}" for k, v in tl.utilisation().items())
        print(
            f"| {s} | {st.decode_seconds:.3f} | {st.decode_tokens / st.decode_seconds:.1f} | "
            f"{base.decode_seconds / st.decode_seconds:.2f}x | {'yes' if same else 'NO'} | "
            f"{peak / 2**20:.1f} / {cap / 2**20:.1f} | {tl.makespan * 1e3:.0f} ms: {util} |"
        )
    if gantt:
        draw_gantt([(f"{s} (emulated, measured)", r[4]) for s, r in rows.items()], gantt)
        print(f"\ngantt of the measured last decode step: {gantt}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller emulated run")
    ap.add_argument("--link-gbps", type=float, default=0.5, help="emulated link bandwidth per direction")
    ap.add_argument("--slowdown", type=float, default=1.5, help="emulated GPU lane: x slower than this CPU")
    ap.add_argument("--dtype", default="float16", help="dtype of the simulated plans (T4: float16)")
    ap.add_argument("--skip-sim", action="store_true")
    ap.add_argument("--gantt", default=None, help="PNG of the emulated runs' measured last decode step")
    ap.add_argument("--skip-emulated", action="store_true")
    a = ap.parse_args()
    if not a.skip_sim:
        simulated(a.dtype)
    if not a.skip_emulated:
        emulated(a.link_gbps, a.quick, a.slowdown, a.gantt)


if __name__ == "__main__":
    main()
