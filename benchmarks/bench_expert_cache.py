"""Small-batch mode on trained routing: expert-cache policies simulated and measured, and latency
mode against throughput mode.

The model is `benchmarks/train_small_moe.py`'s 32-layer Mixtral (8 experts, top-2, as Mixtral 8x7B,
so its traces drive a Mixtral 8x7B-shaped simulation layer for layer). Two prompt sets of code
snippets: the EAM collection's, from the training files, and a held-out one, from the files the
model never saw; every figure below is on the held-out set.

(a) hit rate, prefetch recall, GoodPred and bytes moved of every policy (on-demand, LRU, LFU,
    MoE-Infinity, ProMoE, DuoServe, CoServe, combined) at cache sizes of 10-75% of the experts,
    batch 1 / 4 / 16, and simulated time per output token on T4 and L4 (Mixtral 8x7B costs),
    with the predictors' held-out accuracy and a plot;
(b) measured on the emulated device with a slow link: the trained model itself in latency mode,
    every policy, time per output token;
(c) latency mode against throughput mode (CGOPipe) for jobs of 1-4 requests: the HRM's prediction
    for Mixtral 8x7B on a T4, and wall clock on the emulated device with a small device memory;
(d) a Composition-of-Experts job over two checkpoints: CoServe's grouped schedule against FCFS.

    python benchmarks/train_small_moe.py --minutes 18 --layers 32 --output benchmarks/models/stdlib-moe-32l
    python benchmarks/bench_expert_cache.py --model benchmarks/models/stdlib-moe-32l
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_small_moe import stdlib_files  # noqa: E402

from hrm import WorkloadSpec, get_hardware, get_model  # noqa: E402
from moelight import LLM, SamplingParams  # noqa: E402
from moelight.expert_cache.cache_simulator import simulate_cache  # noqa: E402
from moelight.expert_cache.eam import EAMCollection, eam_of  # noqa: E402
from moelight.expert_cache.policy_registry import make_policy  # noqa: E402
from moelight.expert_cache.predictor_training import train_predictors  # noqa: E402
from moelight.jobs.trace_job import trace_requests  # noqa: E402
from moelight.loading.model_source import load_model, resolve_model  # noqa: E402
from moelight.tokenization.tokenizer import load_tokenizer  # noqa: E402
from optimizer import fit_policy, plan, predict_job  # noqa: E402
from optimizer.latency_mode import predict_latency_mode  # noqa: E402

SIZES = (0.1, 0.25, 0.5, 0.75)


def snippets(files: list[Path], n: int, seed: int) -> list[str]:
    """n code snippets: a function's first lines (from its `def` up to 240 characters)."""
    rng = random.Random(seed)
    out = []
    for f in rng.sample(files, len(files)):
        lines = f.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        if starts:
            i = rng.choice(starts)
            out.append("\n".join(lines[i : i + 8])[:240])
        if len(out) == n:
            return out
    return out


def traced(model, tok, texts: list[str], gen: int, name: str):
    prompts = [tok.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=gen, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    return trace_requests(model, (2,), [f"{name}{i}" for i in range(len(prompts))], prompts, params,
                          [0] * len(prompts), name, hidden=True)


VARIANTS = [("on-demand", "on-demand", None), ("lru", "lru", None), ("lfu", "lfu", None),
            ("moe-infinity", "moe-infinity", None), ("moe-infinity, 1 prefetch/layer", "moe-infinity", 1),
            ("promoe", "promoe", None), ("duoserve", "duoserve", None), ("coserve", "coserve", None),
            ("combined", "combined", None)]


def predictability(build, test, eamc, E) -> None:
    """How well each source names a decode token's experts: its layer's top-2 by the matched EAM
    (MoE-Infinity), by the sequence's own history, and by the build set's popularity."""
    glob = sum(eam_of(r.experts, E) for r in build.requests)
    hits, n = {"matched EAM": 0, "own history": 0, "popularity": 0}, 0
    for r in test.requests:
        for pos in range(r.prompt_len, r.tokens):
            cur = eam_of(r.experts[:pos], E)
            srcs = {"matched EAM": eamc.nearest(cur), "own history": cur, "popularity": glob}
            for j in range(r.experts.shape[1]):
                actual = set(r.experts[pos, j].tolist()) - {-1}
                n += len(actual)
                for name, m in srcs.items():
                    hits[name] += len(actual & set(np.argsort(-m[j])[:2].tolist()))
    print("\n### share of a decode token's experts among its layer's predicted top-2 (held-out trace)\n")
    print("| " + " | ".join(hits) + " |\n|" + "---|" * len(hits))
    print("| " + " | ".join(f"{v / n:.1%}" for v in hits.values()) + " |")


def simulated(trace, eamc, preds, L, E, plot_dir: Path | None) -> None:
    spec = get_model("mixtral-8x7b")
    print("\n### (a) simulated on the held-out trace (Mixtral 8x7B costs, float16)\n")
    print("| batch | cache | policy | hit rate | prefetch recall | GoodPred | GB moved | on CPU "
          "| T4 TPOT p50 / p90 ms | L4 TPOT p50 / p90 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t4_results = []
    for batch in (1, 4, 16):
        for size in SIZES:
            slots = max(E, round(size * L * E))
            for label, name, budget in VARIANTS:
                cells = [simulate_cache(trace, lambda n=name: make_policy(n, L, E, eamc, preds.get(n)),
                                        slots, get_hardware(hw), spec, batch=batch, prefetch_per_layer=budget)
                         for hw in ("t4", "l4")]
                s, p4, pl = cells[0].stats, cells[0].percentiles(), cells[1].percentiles()
                cells[0].policy = label
                t4_results.append(cells[0])
                print(f"| {batch} | {size:.0%} | {label} | {s.hit_rate:.1%} | {s.prefetch_recall:.1%} | "
                      f"{s.good_pred:.1%} | {s.fetched_bytes / 1e9:.0f} | {s.cpu_executed} | "
                      f"{p4['p50']:.0f} / {p4['p90']:.0f} | {pl['p50']:.0f} / {pl['p90']:.0f} |")
    if plot_dir is not None:
        from moelight.expert_cache.plots import plot_cache_sweep

        print("\nplots (T4): " + ", ".join(str(p) for p in plot_cache_sweep(t4_results, L * E, plot_dir)))


def measured(model_dir: Path, texts: list[str], files: dict[str, Path], link_gbps: float, runs: int) -> None:
    print(f"\n### (b) emulated device, batch 1, cache 25%, link {link_gbps} GB/s, {len(texts)} held-out requests "
          f"of 24 tokens, {runs} runs (median [min-max])\n")
    print("| policy | TPOT p50 ms | TPOT p90 ms | hit rate | prefetch recall | GoodPred | on CPU | MiB moved |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        hw = get_hardware("t4").to_dict() | {"name": "t4-slow-link"}
        hw["link"] = {"h2d": link_gbps * 1e9, "d2h": link_gbps * 1e9}
        (Path(tmp) / "hw.json").write_text(json.dumps(hw))
        for label, name, budget in [v for v in VARIANTS if v[1] != "lfu"]:
            reps = []
            for _ in range(runs):
                llm = LLM(str(model_dir), dtype="float32", device="emulated", hardware=str(Path(tmp) / "hw.json"),
                          mode="latency", cache_policy=name, cache_size=0.25, batch_size=1, prefetch_per_layer=budget,
                          eamc=str(files["eamc"]) if name == "moe-infinity" else None,
                          predictor=str(files[name]) if name in files else None)
                try:
                    llm.generate(texts, SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True))
                    reps.append(llm.last_report)
                finally:
                    llm.close()
            span = lambda xs: f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"  # noqa: E731
            c = reps[0].cache
            print(f"| {label} | {span([r.tpot_ms['p50'] for r in reps])} | {span([r.tpot_ms['p90'] for r in reps])} "
                  f"| {c['hit_rate']:.1%} | {c['prefetch_recall']:.1%} | {c['good_pred']:.1%} | "
                  f"{c['cpu_executed']} | {c['fetched_bytes'] / 2**20:.0f} |")


def modes(model_dir: Path, texts: list[str], link_gbps: float, device_mb: int) -> None:
    print("\n### (c) latency mode against throughput mode (CGOPipe)\n")
    print("HRM, Mixtral 8x7B on a T4 (float16), MT-Bench-like prompt 77, gen 128:\n")
    print("| requests | throughput mode tok/s | latency mode, misses fetched | latency mode, misses on the CPU "
          "(combined) | best / throughput |")
    print("|---|---|---|---|---|")
    hw, m = get_hardware("t4"), get_model("mixtral-8x7b")
    for n in (1, 2, 4, 16):
        wl = WorkloadSpec(77, 128, 418)
        pol = fit_policy(plan(hw, m, wl, "float16", family="cgopipe").policy, n)
        thr = predict_job(hw, m, wl, pol, n)["end_to_end_tokens_per_s"]
        fetched, offload = (predict_latency_mode(hw, m, wl, n, n, "float16", cpu_offload=c).end_to_end_tokens_per_s
                            for c in (False, True))
        print(f"| {n} | {thr:.2f} | {fetched:.2f} | {offload:.2f} | {max(fetched, offload) / thr:.2f}x |")
    print(f"\nemulated device ({device_mb} MiB, link {link_gbps} GB/s), the trained model in float32, 24 new "
          "tokens per request, end-to-end tok/s:\n")
    print("| requests | throughput mode | latency mode | latency / throughput | policies |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        hw = get_hardware("t4").to_dict() | {"name": "small-gpu"}
        hw["gpu"]["memory_bytes"] = device_mb * 2**20
        hw["link"] = {"h2d": link_gbps * 1e9, "d2h": link_gbps * 1e9}
        path = Path(tmp) / "hw.json"
        path.write_text(json.dumps(hw))
        for n in (1, 4):
            rate, how = {}, {}
            for mode in ("throughput", "latency"):
                llm = LLM(str(model_dir), dtype="float32", device="emulated", hardware=str(path), mode=mode)
                try:
                    llm.generate(texts[:n], SamplingParams(max_tokens=24, temperature=0.8, seed=2, ignore_eos=True))
                    rate[mode] = llm.last_report.end_to_end_tokens_per_s
                    p = llm.last_report.policy
                    how[mode] = (f"N {p['batch_size']}, r_w {p['r_w']:.2f}" if mode == "throughput"
                                 else f"{p['cache']['slots']} slots")
                finally:
                    llm.close()
            print(f"| {n} | {rate['throughput']:.1f} | {rate['latency']:.1f} | "
                  f"{rate['latency'] / rate['throughput']:.2f}x | {how['throughput']}; {how['latency']} |")


def coe(model_dir: Path, texts: list[str], requests: int, runs: int) -> None:
    """A CoE job over two checkpoints (the trained model and a dummy Mixtral of another shape) with
    requests alternating between them: CoServe's grouped schedule against first-come-first-served."""
    from moelight.jobs.dataset_job import run_job
    from moelight.jobs.run_options import RunOptions

    print(f"\n### (d) a CoE job: {requests} requests alternating between two models, CPU executor, "
          f"{runs} runs (median [min-max])\n")
    print("| schedule | model switches | end-to-end tok/s (loads included) | load seconds |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "coe.json"
        spec.write_text(json.dumps({"models": {"code": str(model_dir), "chat": "tiny"},
                                    "router": {"default": "chat"}}))
        data = Path(tmp) / "req.jsonl"
        data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": texts[i % len(texts)],
                                            "model": "code" if i % 2 else "chat"}) + "\n" for i in range(requests)))
        for order in ("fcfs", "grouped"):
            reps = []
            for k in range(runs):
                out = Path(tmp) / f"{order}{k}.jsonl"
                reps.append(run_job(RunOptions(model=str(spec), dataset=data, output=out, gen_len=16, ignore_eos=True,
                                               dtype="float32", device="cpu", hardware="cpu-server", progress=False,
                                               coe_order=order)))
            span = lambda xs: f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"  # noqa: E731
            print(f"| {order} | {reps[0].policy['coe']['switches']} | "
                  f"{span([r.end_to_end_tokens_per_s for r in reps])} | {span([r.load_seconds for r in reps])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("benchmarks/models/stdlib-moe-32l"))
    ap.add_argument("--build-prompts", type=int, default=64)
    ap.add_argument("--held-out-prompts", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per traced request")
    ap.add_argument("--capacity", type=int, default=32, help="EAM collection size")
    ap.add_argument("--link-gbps", type=float, default=0.5, help="emulated link for (b) and (c)")
    ap.add_argument("--device-mb", type=int, default=48, help="emulated device memory for (c)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a, b, c, d")
    ap.add_argument("--plot", type=Path, default=None, help="draw (a)'s T4 sweep into this folder")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for (b) and (c): one leaves the other core to the emulated link's copy "
                         "thread (with two, compute and copies fight for this 2-core host's cores)")
    a = ap.parse_args()
    src = resolve_model(str(a.model), "auto", "float32")
    model = load_model(src)
    tok = load_tokenizer(a.model, model_vocab_size=src.config.vocab_size)
    train, held = stdlib_files()
    build_texts, held_texts = snippets(train, a.build_prompts, 1), snippets(held, a.held_out_prompts, 2)
    build = traced(model, tok, build_texts, a.gen, "build")
    test = traced(model, tok, held_texts, a.gen, "held")
    L, E = len(test.model.moe_layers), test.model.num_experts
    eamc = EAMCollection.build(np.stack([eam_of(r.experts, E) for r in build.requests]), a.capacity)
    preds = {k: train_predictors(build, k) for k in ("promoe", "duoserve", "coserve")}
    print("predictors, trained on nine tenths of the build trace, accuracy on its other tenth (the share of a "
          "layer's chosen experts among the predicted top-2): "
          + ", ".join(f"{k} {p.accuracy:.1%}" for k, p in preds.items() if p.mlps))
    print(f"model {a.model} ({L} MoE layers x {E} experts); EAM collection: {len(eamc.eams)} of "
          f"{len(build.requests)} build-set EAMs; held-out trace: {len(test.requests)} requests, "
          f"{sum(r.tokens for r in test.requests)} tokens")
    skip = set(a.skip.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        files = {"eamc": eamc.save(Path(tmp) / "eamc.npz")} | {k: p.save(Path(tmp) / f"{k}.npz")
                                                               for k, p in preds.items()}
        if "a" not in skip:
            predictability(build, test, eamc, E)
            simulated(test, eamc, preds, L, E, a.plot)
        torch.set_num_threads(a.threads)
        if "b" not in skip:
            measured(a.model, held_texts[:8], files, a.link_gbps, a.runs)
        if "c" not in skip:
            modes(a.model, held_texts, a.link_gbps, a.device_mb)
        if "d" not in skip:
            coe(a.model, held_texts, 24, a.runs)


if __name__ == "__main__":
    main()
