"""Decode attention on a KV cache on 4 KiB pages against the same cache on 2 MiB huge pages.

The engine allocates its KV cache with moelight.runtime.host_memory.empty_huge; this measures what
that buys. Same kernel, same bytes: each pair times the two caches in alternating order,
each call after an L3-evicting read, and a read-bandwidth probe before each pair labels the
host's state (its bandwidth jumps between ~40 and ~80 GB/s within seconds). Reports the
median time ratio huge / 4 KiB (< 1: huge pages faster), overall and per host state.

    OMP_WAIT_POLICY=passive python benchmarks/ab_kv_pages.py --out benchmarks/results/attention_kv_pages.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import HKV, HQ, D, decode_case, parse_case, probe_buffers, read_bw_now  # noqa: E402

import cpu_kernels  # noqa: E402
from moelight.runtime.host_memory import empty_huge  # noqa: E402

GB = 1e9
HIGH_STATE_GBS = 58.0  # probes above this are the host's high-bandwidth state


def cache_pair(b: int, ctx: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """bench_attention.decode_case over identical bytes: (on 4 KiB pages, on huge pages)."""
    cases = []
    for alloc in (lambda shape, dt: torch.empty(shape, dtype=dt), empty_huge):
        torch.manual_seed(0)
        cases.append(decode_case(b, ctx, dtype, alloc))
    return cases[0], cases[1]


def paired(args_small: tuple, args_huge: tuple, bufs, evict: torch.Tensor, pairs: int) -> list[tuple]:
    """(probe GB/s, time on 4 KiB pages, time on huge pages) per pair, order alternating."""
    f = cpu_kernels.decode_attention
    f(*args_small)
    f(*args_huge)
    rows = []
    for i in range(pairs):
        bw = read_bw_now(bufs)
        t = {}
        for name, a in (("small", args_small), ("huge", args_huge)) if i % 2 == 0 else (
                ("huge", args_huge), ("small", args_small)):
            evict.sum()
            t0 = time.perf_counter()
            f(*a)
            t[name] = time.perf_counter() - t0
        rows.append((bw, t["small"], t["huge"]))
    return rows


def ratio_cells(rows: list[tuple], nbytes: int) -> str:
    """Table cells of paired rows: median GB/s of each side, then the B/A time ratio over all
    pairs, the low-state pairs and the high-state pairs."""
    return (f"| {nbytes / statistics.median(a for _, a, _ in rows) / GB:.1f} "
            f"| {nbytes / statistics.median(b for _, _, b in rows) / GB:.1f} | {summary(rows)} "
            f"| {summary([x for x in rows if x[0] < HIGH_STATE_GBS])} "
            f"| {summary([x for x in rows if x[0] >= HIGH_STATE_GBS])} |")


def summary(rows: list[tuple]) -> str:
    if not rows:
        return "–"
    r = [h / s for _, s, h in rows]
    return f"{statistics.median(r):.3f} ({min(r):.2f}–{max(r):.2f}, n={len(r)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64x512", "256x512", "64x2048"], help="BxCTX")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bufs, evict = probe_buffers(), torch.ones(2**25)
    head = ["| dtype | B | ctx | KV MiB | 4 KiB GB/s (median) | huge GB/s (median) "
            "| time huge / 4 KiB, all pairs | probe < 58 GB/s | probe ≥ 58 GB/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    lines = list(head)
    for dt in args.dtypes:
        for case in args.cases:
            b, ctx = parse_case(case)
            small, huge = cache_pair(b, ctx, getattr(torch, dt))
            torch.testing.assert_close(cpu_kernels.decode_attention(*small["args"]),
                                       cpu_kernels.decode_attention(*huge["args"]), atol=0, rtol=0)
            rows = paired(small["args"], huge["args"], bufs, evict, args.pairs)
            nbytes = small["kv_bytes"]
            line = f"| {dt} | {b} | {ctx} | {nbytes / 2**20:.0f} " + ratio_cells(rows, nbytes)
            print(line, flush=True)
            lines.append(line)
            del small, huge
    if args.out:
        md = ["# Decode attention: KV cache on 4 KiB pages vs 2 MiB huge pages (paired, one process)", "",
              f"Command: `python {' '.join(sys.argv)}`", "",
              f"Backend `{cpu_kernels.kernel_backend()}`, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, Hq={HQ}, Hkv={HKV}, d={D}, {args.pairs} pairs per case.", "", *lines, ""]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(md))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
