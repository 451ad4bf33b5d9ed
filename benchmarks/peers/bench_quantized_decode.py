"""Quantized experts beside llama.cpp's quantized formats: bf16 / int8 / int4 moelight against
llama.cpp's BF16 / Q8_0 / Q4_K_M on the same bench-1b weights, at small batches (where decode is
bound by reading the weights) and at the README job's batch.

- moelight: the README's `moelight run` with `--num-requests B --batch-size B` (and `--quantize`),
  the prompts of the README job, figures from the report it saves. Dummy int8 / int4 weights are drawn
  as codes, not quantized from the bf16 ones: the speed is the same, the values are not.
- llama.cpp: `llama-batched-bench` (build_llama_cpp.sh, plus its `llama-quantize` target) on the GGUF
  gguf_from_moelight.py writes, quantized by llama-quantize; prompt = the job's mean prompt,
  `-npl B`.

- `--model PRESET --layers N` (moelight only): the preset's config.json with N layers, in a folder loaded
  with dummy weights (byte tokenizer), so a large model's per-layer shape runs on a small host. The report
  states the bandwidth-bound ceiling of each format against bf16 on that shape (decode_ceiling.py).

    bash benchmarks/peers/build_llama_cpp.sh && cmake --build <llama.cpp>/build --target llama-quantize
    python benchmarks/peers/bench_quantized_decode.py --batches 1 8 --gen-len 32 --runs 3 \\
        --output benchmarks/results/quantized_decode.md
    python benchmarks/peers/bench_quantized_decode.py --model mixtral-8x7b --layers 5 --formats bf16 int4 \\
        --batches 1 --gen-len 64 --runs 4 --no-llama
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import PROMPTS, ROOT, job_prompts, machine  # noqa: E402
from decode_ceiling import PRESET_CONFIGS, ceiling, model_config, shape_config, token_bytes  # noqa: E402
from gguf_from_moelight import DEFAULT_LLAMA, write_gguf  # noqa: E402

FORMATS = [("bf16", None, "BF16"), ("int8", "int8", "Q8_0"), ("int4", "int4", "Q4_K_M")]


def run_moelight(out_dir: Path, batch: int, gen: int, quantize: str | None, model: str = "bench-1b") -> dict:
    """One `moelight run`; `model` a preset, or a config-only folder (dummy weights, byte tokenizer)."""
    out = out_dir / "results.jsonl"
    cmd = ["moelight", "run", "--dataset", str(PROMPTS), "--model", model, "--load-format", "dummy",
           "--num-requests", str(batch), "--batch-size", str(batch), "--gen-len", str(gen), "--ignore-eos",
           "--overwrite", "--no-progress", "--output", str(out)]
    if Path(model).is_dir():
        cmd += ["--tokenizer", "byte"]
    if quantize:
        cmd += ["--quantize", quantize]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rep = json.loads(out.with_name(out.name + ".report.json").read_text())
    return {"decode": rep["decode_tokens_per_s"], "e2e": rep["end_to_end_tokens_per_s"],
            "peak_gib": rep["peak_memory_bytes"] / 2**30, "tpot_p50": rep["tpot_ms"].get("p50", 0.0)}


def run_llama(binary: Path, gguf: Path, prompt_len: int, gen: int, batch: int, threads: int) -> dict:
    cmd = [str(binary), "-m", str(gguf), "-c", str(batch * (prompt_len + gen) + 16), "-b", "2048", "-ub", "512",
           "-npp", str(prompt_len), "-ntg", str(gen), "-npl", str(batch), "-t", str(threads),
           "--output-format", "jsonl"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    row = json.loads([x for x in res.stdout.splitlines() if x.startswith("{")][-1])
    return {"decode": row["speed_tg"], "e2e": row["pl"] * row["tg"] / row["t"]}


def quantized_ggufs(llama_dir: Path, tmp: Path) -> dict[str, Path]:
    bf16 = write_gguf("bench-1b", tmp / "bench-1b-BF16.gguf", "bf16", llama_dir)
    files = {"BF16": bf16}
    quantize = llama_dir / "build/bin/llama-quantize"
    for _, _, kind in FORMATS[1:]:
        files[kind] = tmp / f"bench-1b-{kind}.gguf"
        subprocess.run([str(quantize), str(bf16), str(files[kind]), kind], check=True, capture_output=True)
    return files


def mean_prompts(batches: list[int]) -> str:
    """The mean length of the prompts moelight's run at each batch B takes (the job's first B)."""
    prompts = job_prompts(max(batches))
    return ", ".join(f"B = {b}: {sum(map(len, prompts[:b])) / b:.0f}" for b in batches)


def spread(xs: list[float], digits: int = 2) -> str:
    xs = sorted(xs)
    return f"{xs[0]:.{digits}f} / {statistics.median(xs):.{digits}f} / {xs[-1]:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-1b", help="a Mixtral-shaped preset")
    ap.add_argument("--layers", type=int, help="run the preset cut to this many layers (moelight only)")
    ap.add_argument("--formats", nargs="+", choices=[f[0] for f in FORMATS], default=[f[0] for f in FORMATS],
                    help="the first is the baseline the others are compared with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA)
    ap.add_argument("--no-llama", action="store_true", help="moelight only")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    prompts = job_prompts(256)
    prompt_len = round(sum(map(len, prompts)) / len(prompts))
    binary = args.llama_dir / "build/bin/llama-batched-bench"
    use_llama = not args.no_llama
    if use_llama and (args.layers is not None or args.model != "bench-1b"):
        raise SystemExit("--model / --layers run moelight only: pass --no-llama")
    if args.layers is not None and (args.layers < 1 or args.model not in PRESET_CONFIGS):
        raise SystemExit(f"--layers {args.layers} --model {args.model}: --layers takes a count >= 1 and a preset "
                         f"({', '.join(sorted(PRESET_CONFIGS))})")
    formats = [next(f for f in FORMATS if f[0] == name) for name in args.formats]
    if use_llama and not (binary.is_file() and (args.llama_dir / "build/bin/llama-quantize").is_file()):
        raise SystemExit(f"{args.llama_dir}/build/bin: llama-batched-bench and llama-quantize not built "
                         "(build_llama_cpp.sh, then its llama-quantize target), or pass --no-llama")
    results: dict[tuple[str, str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ggufs = quantized_ggufs(args.llama_dir, Path(tmp)) if use_llama else {}
        model = args.model if args.layers is None else str(shape_config(args.model, args.layers, Path(tmp) / "model"))
        cfg = model_config(model)
        for r in range(args.runs):  # runs outermost, engines and formats alternating within each
            for batch in args.batches:
                for name, quantize, kind in (formats if r % 2 == 0 else formats[::-1]):
                    row = run_moelight(Path(tmp), batch, args.gen_len, quantize, model)
                    results.setdefault(("moelight", name, batch), []).append(row)
                    print(f"run {r + 1} batch {batch} moelight {name}: decode {row['decode']:.2f} tok/s, step p50 "
                          f"{row['tpot_p50']:.1f} ms, peak {row['peak_gib']:.2f} GiB", flush=True)
                    if use_llama:
                        row = run_llama(binary, ggufs[kind], prompt_len, args.gen_len, batch, threads)
                        results.setdefault(("llama.cpp", kind, batch), []).append(row)
                        print(f"run {r + 1} batch {batch} llama.cpp {kind}: decode {row['decode']:.1f} tok/s",
                              flush=True)
    text = report(results, args, prompt_len, formats, cfg)
    print(text)
    if args.output:
        args.output.write_text(text)


def report(results: dict, args, prompt_len: int, formats: list[tuple], cfg) -> str:
    """One row per (batch, engine, format); each run's decode against the same run's baseline (the first of
    `formats`), and for moelight the bandwidth-bound ceiling of that ratio on the model's shape."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    shape = args.model if args.layers is None else f"{args.model} cut to {args.layers} layers (dummy weights)"
    per_token = {f[0]: sum(token_bytes(cfg, f[1]).values()) / 1e6 for f in formats}
    lines = [f"# Quantized experts at small batches: moelight beside llama.cpp ({args.runs} runs)", "",
             f"`python benchmarks/peers/bench_quantized_decode.py {' '.join(sys.argv[1:])}` at {commit}; "
             f"{machine()}; {shape}; prompts: llama.cpp {prompt_len} tokens (the job's mean), moelight the job's "
             f"first B ({mean_prompts(args.batches)} tokens, mean); {args.gen_len} new tokens. Weight bytes a "
             "batch-1 token reads: " + ", ".join(f"{k} {v:.1f} MB" for k, v in per_token.items()) + ".", "",
             f"| batch | engine | weights | decode tok/s (min / median / max) | e2e tok/s (median) | peak GiB "
             f"| decode vs its {formats[0][0]} per run (min / median / max) | bandwidth-bound ceiling |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in args.batches:
        for engine, col in (("moelight", 0), ("llama.cpp", 2)):
            names = [f[col] for f in formats]
            base = results.get((engine, names[0], batch))
            for f, name in zip(formats, names, strict=True):
                rows = results.get((engine, name, batch))
                if not rows:
                    continue
                dec = [x["decode"] for x in rows]
                gains = [d / b["decode"] for d, b in zip(dec, base, strict=True)]
                peak = f"{max(x['peak_gib'] for x in rows):.2f}" if "peak_gib" in rows[0] else ""
                roof = f"{ceiling(cfg, f[1], formats[0][1]):.3f}x" if engine == "moelight" else ""
                lines.append(f"| {batch} | {engine} | {name} | {spread(dec)} | "
                             f"{statistics.median(x['e2e'] for x in rows):.2f} | {peak} | "
                             f"{spread(gains, 2)}x | {roof} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
