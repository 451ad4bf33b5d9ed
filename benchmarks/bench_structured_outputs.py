"""Structured outputs' cost per generated token: the same batch of requests free and constrained by a
JSON schema (xgrammar's token bitmask each step), through the Python API.

Every request draws up to --gen-len tokens (temperature 0.8, seeded; EOS ignored when free). A
constrained sample ends where its JSON closes, so the two runs generate different token counts: the
figure compared is generation seconds per generated token (prefill included in both), and the
grammar's own share measured inside the sampler (bitmask fill, mask application, matcher advance).
Runs alternate, --repeat times; every constrained output is checked to parse and validate.

    python benchmarks/bench_structured_outputs.py --batch 256 --output benchmarks/results/structured_outputs.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_report import emit  # noqa: E402

from cpu_kernels import kernel_backend  # noqa: E402
from moelight import LLM, SamplingParams  # noqa: E402
from moelight.sampling import structured  # noqa: E402
from moelight.sampling.params import StructuredOutputsParams  # noqa: E402

# bounded fields, so random weights finish most objects within --gen-len tokens
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}


def valid(obj) -> bool:
    """SCHEMA's constraints, checked by hand."""
    return (isinstance(obj, dict) and set(obj) <= {"name", "age", "tags"} and {"name", "age"} <= set(obj)
            and isinstance(obj["name"], str) and len(obj["name"]) <= 12
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
            and all(isinstance(t, str) and len(t) <= 8 for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 2)


class GrammarClock:
    """Seconds spent in the grammar engine's calls (wrapped around structured.Constraint's methods)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    llm = LLM(args.model, load_format="dummy", dtype=args.dtype, batch_size=args.batch)
    prompts = [f"Person {i} as JSON with name, age and tags:" for i in range(args.batch)]
    clock = GrammarClock()
    clock.wrap(structured.Constraint, "mask")  # bitmask fill and its application to a row's logits
    clock.wrap(structured.Constraint, "accept")  # the matcher advanced with the sampled token
    kinds = {
        "free": SamplingParams(max_tokens=args.gen_len, temperature=0.8, seed=1, ignore_eos=True),
        "json schema": SamplingParams(max_tokens=args.gen_len, temperature=0.8, seed=1,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    llm.generate(prompts[:4], kinds["json schema"])  # warm-up: compiles and caches the grammar
    llm.generate(prompts[:4], kinds["free"])
    got: dict[str, list] = {k: [] for k in kinds}
    finished = checked = 0
    for _ in range(args.repeat):
        for kind, params in kinds.items():
            clock.seconds = 0.0
            outs = llm.generate(prompts, params)
            r = llm.last_report
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            got[kind].append((r.generation_seconds / tokens * 1e3, clock.seconds / tokens * 1e3, tokens,
                              r.batch_size))
            if kind != "free":
                for o in outs:
                    if o.outputs[0].finish_reason == "stop":
                        finished += 1
                        checked += valid(json.loads(o.outputs[0].text))
            print(kind, got[kind][-1], flush=True)

    lines = ["# Structured outputs: cost per generated token", "",
             "Command: `python " + " ".join(sys.argv) + "`", "",
             f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"kernels {kernel_backend()}. Model {args.model} ({args.dtype}, dummy weights); {args.batch} "
             f"requests, up to {args.gen_len} tokens each; {args.repeat} runs each, alternating.", "",
             "| requests | N | generated tokens | ms per generated token (median, min-max) | grammar ms per token |",
             "|---|---|---|---|---|"]
    med = {}
    for kind, runs in got.items():
        per = [r[0] for r in runs]
        med[kind] = statistics.median(per)
        lines.append(f"| {kind} | {runs[0][3]} | {runs[0][2]} | {med[kind]:.2f} ({min(per):.2f}-{max(per):.2f}) | "
                     f"{statistics.median(r[1] for r in runs):.3f} |")
    lines += ["", f"Constrained / free time per generated token: {med['json schema'] / med['free']:.2f}x. "
              f"Constrained outputs whose JSON closed within {args.gen_len} tokens: {finished} of "
              f"{args.batch * args.repeat}, of which {checked} parse and satisfy the schema (checked by hand); the "
              "rest stopped at max_tokens inside the object."]
    emit(lines, args.output)


if __name__ == "__main__":
    main()
