"""The README's main job beside llama.cpp and transformers, in one sitting on this machine.

Job: bench-1b (a 0.79 B-parameter Mixtral shape), bf16, the same seed-0 random weights in all
three, 256 requests from workloads/examples/prompts.jsonl (byte tokenizer: mean prompt ~68
tokens), 64 new tokens each, EOS ignored. End-to-end = generated tokens / wall time, prefill
included.

- moelight: the README's `moelight run` command itself (planned policy), figures from the
  report it saves.
- llama.cpp: `llama-batched-bench` built from source with native flags (build_llama_cpp.sh) on
  the GGUF written by gguf_from_moelight.py, prompt length = the job's mean prompt, 64 new
  tokens, swept over parallel sequences in the first run; its best point runs again in the
  later runs.
- transformers: `generate` on MixtralForCausalLM holding the same weights, its best batch of a
  short sweep on a subset of the prompts (at 256 its padded eager attention does not fit),
  swept in the first run, its best batch in the later ones.

    bash benchmarks/peers/build_llama_cpp.sh
    python benchmarks/peers/bench_peers.py --runs 3 --output benchmarks/results/peers.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PROMPTS = ROOT / "workloads/examples/prompts.jsonl"
README_JOB = ["moelight", "run", "--dataset", str(PROMPTS), "--model", "bench-1b", "--load-format", "dummy",
              "--num-requests", "256", "--gen-len", "64", "--ignore-eos", "--overwrite", "--no-progress"]


def job_prompts(n: int) -> list[list[int]]:
    """The README job's token lists: the prompt file replicated to n, byte-tokenized as moelight does."""
    from moelight.tokenization.byte_tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [tok.encode(texts[i % len(texts)]) for i in range(n)]


def run_moelight(out_dir: Path) -> dict:
    out = out_dir / "results.jsonl"
    subprocess.run([*README_JOB, "--output", str(out)], check=True, capture_output=True, text=True, cwd=ROOT)
    rep = json.loads(out.with_name(out.name + ".report.json").read_text())
    return {"engine": "moelight", "batch": rep["batch_size"], "e2e": rep["end_to_end_tokens_per_s"],
            "prefill": rep["prefill_tokens_per_s"], "decode": rep["decode_tokens_per_s"]}


def run_llama_cpp(binary: Path, gguf: Path, prompt_len: int, gen: int, npls: list[int], threads: int) -> dict:
    """Best sweep point by generated tokens / total time; prefill and decode rates of that point."""
    best = None
    for npl in npls:
        cmd = [str(binary), "-m", str(gguf), "-c", str(npl * (prompt_len + gen) + 16), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(gen), "-npl", str(npl), "-t", str(threads),
               "--output-format", "jsonl"]
        res = subprocess.run(cmd, check=True, capture_output=True, text=True)
        row = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
        e2e = row["pl"] * row["tg"] / row["t"]
        point = {"engine": "llama.cpp", "batch": npl, "e2e": e2e, "prefill": row["speed_pp"],
                 "decode": row["speed_tg"]}
        print(f"  llama.cpp npl {npl}: {e2e:.1f} tok/s end to end", flush=True)
        if best is None or e2e > best["e2e"]:
            best = point
    return best


def run_transformers(prompts: list[list[int]], gen: int, batches: list[int]) -> dict:
    from bench_engine import hf_model_from, run_hf

    from moelight.loading.presets import preset_config
    from moelight.loading.weights import build_model

    cfg = preset_config("bench-1b")
    ours = build_model(cfg, torch.bfloat16, None, 0)
    hf = hf_model_from(ours.state_dict(), cfg, torch.bfloat16)
    best = None
    for b in batches:
        seconds, generated = run_hf(hf, prompts, gen, b)
        point = {"engine": "transformers", "batch": b, "e2e": generated / seconds, "prefill": None, "decode": None}
        print(f"  transformers batch {b}: {point['e2e']:.1f} tok/s end to end", flush=True)
        if best is None or point["e2e"] > best["e2e"]:
            best = point
    return best


def machine() -> str:
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    from gguf_from_moelight import DEFAULT_LLAMA, write_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA)
    ap.add_argument("--npl", default="32,64,128,256", help="llama.cpp parallel sequences to sweep")
    ap.add_argument("--hf-batches", default="16,32", help="transformers batch sizes to sweep")
    ap.add_argument("--hf-prompts", type=int, default=64, help="prompts for transformers (its rate scales)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    binary = args.llama_dir / "build/bin/llama-batched-bench"
    if not binary.is_file():
        raise SystemExit(f"{binary}: not built; run benchmarks/peers/build_llama_cpp.sh first")
    threads = torch.get_num_threads()
    prompts = job_prompts(256)
    prompt_len = round(sum(map(len, prompts)) / len(prompts))
    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_gguf("bench-1b", Path(tmp) / "bench-1b-bf16.gguf", "bf16", args.llama_dir)
        runs = []
        npls, hf_batches = [int(x) for x in args.npl.split(",")], [int(x) for x in args.hf_batches.split(",")]
        for r in range(args.runs):
            print(f"run {r + 1}/{args.runs}", flush=True)
            t0 = time.time()
            rows = [run_moelight(Path(tmp)),
                    run_llama_cpp(binary, gguf, prompt_len, 64, npls, threads),
                    run_transformers(prompts[: args.hf_prompts], 64, hf_batches)]
            npls, hf_batches = [rows[1]["batch"]], [rows[2]["batch"]]  # later runs: each peer at its best
            for row in rows:
                print(f"  {row['engine']}: batch {row['batch']}, {row['e2e']:.1f} tok/s end to end", flush=True)
            runs.append(rows)
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
    text = report(runs, prompt_len, args)
    print(text)
    if args.output:
        args.output.write_text(text)


def report(runs: list[list[dict]], prompt_len: int, args) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    fmt = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    lines = [f"# moelight beside llama.cpp and transformers: the README main job ({len(runs)} run(s))", "",
             f"`python benchmarks/peers/bench_peers.py --runs {len(runs)} --npl {args.npl} --hf-batches "
             f"{args.hf_batches} --hf-prompts {args.hf_prompts}` at {commit}; {machine()}; llama.cpp from "
             f"{args.llama_dir}; mean prompt {prompt_len} tokens, 64 new tokens, bf16.", "",
             "| run | engine | batch | end-to-end tok/s | prefill tok/s | decode tok/s | moelight / engine |",
             "|---|---|---|---|---|---|---|"]
    for i, rows in enumerate(runs, 1):
        ours = rows[0]["e2e"]
        for row in rows:
            lines.append(f"| {i} | {row['engine']} | {row['batch']} | {row['e2e']:.1f} | {fmt(row['prefill'])} | "
                         f"{fmt(row['decode'])} | {ours / row['e2e']:.2f}x |")
    lines += ["", "| engine | end-to-end tok/s min / median / max | moelight / engine min / median / max |",
              "|---|---|---|"]
    for j, name in enumerate(r["engine"] for r in runs[0]):
        e2e = sorted(rows[j]["e2e"] for rows in runs)
        ratio = sorted(rows[0]["e2e"] / rows[j]["e2e"] for rows in runs)
        lines.append(f"| {name} | {e2e[0]:.1f} / {statistics.median(e2e):.1f} / {e2e[-1]:.1f} | "
                     f"{ratio[0]:.2f} / {statistics.median(ratio):.2f} / {ratio[-1]:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
