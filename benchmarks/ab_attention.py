"""Decode attention: two versions of cpu_kernels/csrc timed against each other, in one process.

This host's read bandwidth moves between two states within seconds, so runs made one after
the other cannot show a 5% change. Here both source trees are built as separate torch op
libraries (the `moelight` name replaced, so they load side by side), and every case times
them in alternating pairs, each call after an L3-evicting read. The result is the median of
the paired time ratios B/A with its quartiles: < 1 means B is faster.

    git worktree add /tmp/before <commit>
    python benchmarks/ab_attention.py /tmp/before/cpu_kernels/csrc cpu_kernels/csrc --threads 1 2
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import decode_case, parse_case  # noqa: E402

from cpu_kernels.build import CFLAGS, LDFLAGS, SOURCES  # noqa: E402

GB = 1e9


def build_renamed(src: Path, namespace: str):
    """Builds a copy of `src` with `moelight` renamed to `namespace`; returns its decode op.
    Copies live under ~/.cache/moelight_ab, keyed by content, so a rerun does not recompile."""
    from torch.utils.cpp_extension import load

    files = sorted(f for f in src.iterdir() if f.suffix in (".cpp", ".h"))
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:12]
    dst = Path.home() / ".cache" / "moelight_ab" / f"{namespace}_{digest}"
    if not dst.exists():
        tmp = dst.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            (tmp / f.name).write_text(f.read_text().replace("moelight", namespace))
        tmp.rename(dst)
    load(name=f"{namespace}_{digest}", sources=[str(dst / s) for s in SOURCES], extra_cflags=CFLAGS,
         extra_ldflags=LDFLAGS, is_python_module=False)
    return getattr(torch.ops, namespace).decode_attention


def paired_ratio(fa, fb, args: tuple, evict: torch.Tensor, pairs: int) -> dict:
    """Median and quartiles of time(B) / time(A), the order inside each pair alternating."""
    ta, tb, ratios = [], [], []
    for i in range(pairs):
        times = {}
        for name, f in (("a", fa), ("b", fb)) if i % 2 == 0 else (("b", fb), ("a", fa)):
            evict.sum()
            t0 = time.perf_counter()
            f(*args)
            times[name] = time.perf_counter() - t0
        ta.append(times["a"])
        tb.append(times["b"])
        ratios.append(times["b"] / times["a"])
    q = statistics.quantiles(ratios, n=4)
    return {"a": min(ta), "b": min(tb), "ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="csrc tree A (the reference)")
    ap.add_argument("b", type=Path, help="csrc tree B")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="+", default=["64x512", "256x512", "64x2048", "1024x128"],
                    help="BxCTX")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=15)
    ap.add_argument("--slack", type=int, default=0,
                    help="free slots after each (sequence, KV head) block, as in the engine's decode")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args()
    if args.slack < 0:
        ap.error("--slack: free slots cannot be negative")
    fa = build_renamed(args.a.resolve(), "moelight_ab_a")
    fb = build_renamed(args.b.resolve(), "moelight_ab_b")
    evict = torch.ones(2**25)
    rows = ["| threads | dtype | B | ctx | A GB/s (best) | B GB/s (best) | time B/A median (quartiles) |",
            "|---|---|---|---|---|---|---|"]
    for nt in args.threads:
        torch.set_num_threads(nt)
        for dt in args.dtypes:
            for case in args.cases:
                b, ctx = parse_case(case)
                c = decode_case(b, ctx, getattr(torch, dt), slack=args.slack)
                torch.testing.assert_close(fa(*c["args"]), fb(*c["args"]), atol=2e-2, rtol=0)
                r = paired_ratio(fa, fb, c["args"], evict, args.pairs)
                gb = c["kv_bytes"] / GB
                line = (f"| {nt} | {dt} | {b} | {ctx} | {gb / r['a']:.1f} | {gb / r['b']:.1f} "
                        f"| {r['ratio']:.3f} ({r['q1']:.3f}–{r['q3']:.3f}) |")
                print(line, flush=True)
                rows.append(line)
                del c
    if args.out:
        md = ["# Decode attention A/B (paired, one process)", "",
              f"Command: `python {' '.join(sys.argv)}`", "",
              f"A = `{args.a}`, B = `{args.b}`, torch {torch.__version__}, {args.pairs} pairs per case, "
              f"{args.slack} free slots after each (sequence, KV head) block.", "",
              *rows, ""]
        args.out.write_text("\n".join(md))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
