"""Prefix sharing on and off, on the two jobs it is for, through the Python API (the job path).

- system: every MT-Bench question (first turn) behind one shared system prompt of
  --system-tokens tokens, greedy;
- samples: every MT-Bench question asked for n = --n samples (temperature 0.8, seeded).

Each job runs with `enable_prefix_caching` on and off, alternating, --repeat times, on the same
loaded model shape (dummy weights); the planner picks N for each (sharing lets it pick a larger
one) unless --batch-size is given. Reported: prompt tokens prefill computed, end-to-end generated
tok/s (generation time, loading excluded), the median and range over the repeats, and whether the
outputs are identical. Generation lengths are fixed (EOS ignored) so both runs do the same work.

    python benchmarks/bench_prefix_sharing.py --questions PATH/TO/mtbench/question.jsonl \
        --output benchmarks/results/prefix_sharing.md
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_report import emit  # noqa: E402

from cpu_kernels import kernel_backend  # noqa: E402
from moelight import LLM, SamplingParams  # noqa: E402


def questions(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[dict, list]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    r = llm.last_report
    return ({"n": r.batch_size, "computed": r.prefill_computed_tokens, "prompt": r.prompt_tokens,
             "tok_s": r.end_to_end_tokens_per_s, "seconds": r.generation_seconds},
            [[c.token_ids for c in o.outputs] for o in outs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=Path, required=True, help="MT-Bench's question.jsonl")
    ap.add_argument("--model", default="bench-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", default="system,samples")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    texts = questions(args.questions)
    llms = {share: LLM(args.model, load_format="dummy", dtype=args.dtype, enable_prefix_caching=share,
                       **({"batch_size": args.batch_size} if args.batch_size else {})) for share in (False, True)}
    tok = llms[True].tokenizer
    asked = [tok.encode(t) for t in texts]
    rng = random.Random(0)
    system = [rng.randrange(3, llms[True].config.vocab_size) for _ in range(args.system_tokens)]
    jobs = {
        "system": ([system + q for q in asked],
                   SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)),
        "samples": (asked, SamplingParams(n=args.n, max_tokens=args.gen_len, temperature=0.8, seed=1,
                                          ignore_eos=True)),
    }
    rows = []
    for name in args.jobs.split(","):
        prompts, params = jobs[name]
        run(llms[True], prompts[:4], params)  # warm-up (oneDNN primitives, kernels)
        run(llms[False], prompts[:4], params)
        got: dict[bool, list] = {False: [], True: []}
        outs: dict[bool, list] = {}
        for _ in range(args.repeat):
            for share in (False, True):
                fig, outs[share] = run(llms[share], prompts, params)
                got[share].append(fig)
                print(name, "on" if share else "off", fig, flush=True)
        same = outs[False] == outs[True]
        for share in (False, True):
            rates = [f["tok_s"] for f in got[share]]
            f = got[share][0]
            rows.append((name, "on" if share else "off", f["n"], f["prompt"], f["computed"],
                         statistics.median(rates), min(rates), max(rates)))
        off, on = rows[-2][5], rows[-1][5]
        rows.append((name, "on / off", "", "", f"{rows[-1][4] / rows[-2][4]:.3f}", on / off, "", ""))
        rows.append((name, "identical outputs", "", "", "", same, "", ""))

    lines = [
        "# Prefix sharing on and off", "",
        "Command: `python " + " ".join(sys.argv) + "`", "",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, attention "
        f"{kernel_backend()}. Model {args.model} ({args.dtype}, dummy weights); {len(texts)} MT-Bench questions; "
        f"system job: {args.system_tokens}-token shared system prompt, greedy; samples job: n={args.n}, "
        f"temperature 0.8; {args.gen_len} new tokens per sample; {args.repeat} runs each, alternating.", "",
        "| job | sharing | N | prompt tokens | computed by prefill | e2e tok/s (median) | min | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"{c:.1f}" if isinstance(c, float) else str(c) for c in r]
        if r[1] == "on / off":
            cells[5] = f"{r[5]:.2f}x"
        lines.append("| " + " | ".join(cells) + " |")
    emit(lines, args.output)


if __name__ == "__main__":
    main()
