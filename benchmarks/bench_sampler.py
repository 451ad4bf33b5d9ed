"""Host cost of sampling: the sampler's step per variant (batch 256 x vocab 32000) and the stop-string
search's cost per token at 1k / 4k output tokens. CPU time is the figure to compare (this host is shared).

It imports moelight from PYTHONPATH, so one copy of it times two trees, best interleaved:

    git worktree add /tmp/before <commit>
    for i in 1 2 3; do for t in /tmp/before .; do PYTHONPATH=$t python benchmarks/bench_sampler.py; done; done
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import torch

import moelight
from moelight.engine.sequence import Sequence
from moelight.sampling.logits_processors import RowState
from moelight.sampling.params import SamplingParams
from moelight.sampling.sampler import Sampler
from moelight.tokenization.tokenizer import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "stdlib-moe"
P = dict(max_tokens=10**6, ignore_eos=True)
VARIANTS = {  # name: (params, logits scale: 3 a nucleus of ~1500 tokens, 0.05 a flat row as dummy weights give)
    "greedy": (SamplingParams(**P, temperature=0.0), 3.0),
    "temperature 0.8": (SamplingParams(**P, temperature=0.8), 3.0),
    "top_p 0.9": (SamplingParams(**P, temperature=1.0, top_p=0.9), 3.0),
    "top_p 0.9, flat rows": (SamplingParams(**P, temperature=1.0, top_p=0.9), 0.05),
    "top_k 50": (SamplingParams(**P, temperature=1.0, top_k=50), 3.0),
    "top_k 50 + top_p 0.9": (SamplingParams(**P, temperature=1.0, top_k=50, top_p=0.9), 3.0),
    "min_p 0.1": (SamplingParams(**P, temperature=1.0, min_p=0.1), 3.0),
    "repetition 1.2 (greedy)": (SamplingParams(**P, temperature=0.0, repetition_penalty=1.2), 3.0),
    "presence 0.5 (greedy)": (SamplingParams(**P, temperature=0.0, presence_penalty=0.5), 3.0),
}
PROMPT, OUTPUT = 200, 200  # tokens each row's penalties read


def timed(fn, reps: int) -> tuple[float, float]:
    """(CPU, wall) seconds per call, after one warm-up call."""
    fn()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.process_time() - cpu) / reps, (time.perf_counter() - wall) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tree = Path(moelight.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"# moelight {tree} @ {commit}, {args.threads} threads")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(args.batch, args.vocab, generator=g)
    rows = list(range(args.batch))
    for name, (params, scale) in VARIANTS.items():
        sampler = Sampler([params] * args.batch, rows)
        logits = base * scale
        states = None
        if params.has_processors:
            ids = torch.randint(3, args.vocab, (args.batch, PROMPT + OUTPUT), generator=g).tolist()
            states = [RowState(params, r[:PROMPT], r[PROMPT:], frozenset({2})) for r in ids]
        cpu, wall = timed(lambda s=sampler, x=logits, st=states: s(x, rows, st), args.reps)
        print(f"sampler {name:24s} {cpu * 1e3:8.1f} ms CPU/step  {wall * 1e3:8.1f} ms wall/step")
    tok = load_tokenizer(TOKENIZER)
    stops = [f"this is a long stop string number {i:02d} that never occurs" for i in range(20)]
    ids = torch.randint(3, 2048, (4096,), generator=torch.Generator().manual_seed(0)).tolist()

    def decode(x, skip, ctx=()):
        return tok.decode(x, skip, ctx)

    for n in (1024, 4096):
        def generate(n=n) -> None:
            seq = Sequence(0, 10, SamplingParams(**P, stop=stops))
            for t in ids[:n]:
                seq.append(t, {2}, decode)
        cpu, _ = timed(generate, 1)
        print(f"stop strings (20) over {n:5d} tokens {cpu / n * 1e6:8.1f} us CPU/token")


if __name__ == "__main__":
    main()
