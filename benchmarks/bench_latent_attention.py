"""Latent (MLA) decode attention against the GQA kernel at equal context: bytes read per token, time,
and the share of the machine's read bandwidth each reaches.

Shapes (one layer, bf16 cache, every sequence at the same context):
- latent: bench-deepseek / DeepSeek-V2-Lite, 16 heads over rows of 512 + 64 (1,152 B a token);
- GQA bench-1b: 16 query heads over 4 KV heads of 64 (1,024 B a token);
- GQA Mixtral: 32 query heads over 8 KV heads of 128 (4,096 B a token);
- latent, paged: the latent shape through block tables of 16-row pages (prefix sharing's layout),
  each sequence in two runs of pages far apart (a shared prefix's pages, then its own), no page read
  twice: what the paged kernel costs over the ragged one.

For each (sequences, context) the kernel's read rate is timed in alternation with the machine's read
bandwidth (benchmarks/bench_attention.py's paired probe: the C++ streaming read and a torch sum, best
of both, on 4 KiB and huge pages), each kernel call after an L3 eviction; the median of the paired
ratios is reported with its spread. The C++ path in use is named (AMX tiles on a bf16 cache where
the CPU has AMX, else AVX512-BF16 / AVX-512 / AVX2). The README job's decode attention is the
first row: 256 sequences of ~85 prompt tokens plus up to 64 new ones.

    python benchmarks/bench_latent_attention.py --output benchmarks/results/latent_attention.md
    python benchmarks/bench_latent_attention.py --threads 1  # one core against one core's read rate
    python benchmarks/bench_latent_attention.py --quick      # one small case, to check it runs
    python benchmarks/bench_latent_attention.py --isa avx2   # another ISA level this CPU has
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_attention import cold_time, paired_bandwidth, probe_buffers, read_bw_now  # noqa: E402
from markdown_report import commit, emit  # noqa: E402

import cpu_kernels  # noqa: E402
from cpu_kernels import decode_attention, latent_decode_attention, paged_latent_decode_attention  # noqa: E402
from moelight.runtime.host_memory import empty_huge  # noqa: E402

GB = 1e9
# name -> (query heads, KV heads, head dim) for GQA; (heads, row width, latent width) for the latent
SHAPES = {"latent 16 x (512+64)": ("latent", 16, 576, 512),
          "latent 16 x (512+64), paged": ("latent-paged", 16, 576, 512),
          "GQA bench-1b 16/4 x 64": ("gqa", 16, 4, 64), "GQA Mixtral 32/8 x 128": ("gqa", 32, 8, 128)}
PAGE = 16
CASES = [(256, 117), (64, 512), (16, 2048)]  # (sequences, context): the README job's mean first


def case(shape: tuple, b: int, ctx: int, dtype: torch.dtype):
    """(kernel call, bytes of cache it reads, bytes per token and layer) over a cache laid out as the
    engine lays it out (a region per sequence with room to grow, on huge pages)."""
    kind, *dims = shape
    g = torch.Generator().manual_seed(0)
    caps = torch.full((b,), ctx + 64)
    offs, lens = torch.cumsum(caps, 0) - caps, torch.full((b,), ctx)
    if kind == "latent-paged":
        heads, width, latent = dims
        pages = -(-(ctx + 64) // PAGE)
        cache = empty_huge((1, b * pages * PAGE, width), dtype)
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
        first = pages // 2  # each sequence's first half of pages in one region, the rest in another
        own = torch.arange(b * pages).view(b, pages)
        table = torch.cat([own[:, :first], own[:, first:].roll(1, 0)], 1)  # second runs shifted a sequence
        q = torch.randn(b, heads, width, generator=g).to(dtype) * 0.05
        per = width * dtype.itemsize
        return (lambda: paged_latent_decode_attention(q, cache, table, lens, PAGE, 0.07, latent)), b * ctx * per, per
    if kind == "latent":
        heads, width, latent = dims
        cache = empty_huge((1, int(caps.sum()), width), dtype)
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
        q = torch.randn(b, heads, width, generator=g).to(dtype) * 0.05
        per = width * dtype.itemsize
        return (lambda: latent_decode_attention(q, cache, offs, lens, 0.07, latent)), b * ctx * per, per
    hq, hkv, d = dims
    k, v = (empty_huge((hkv, int(caps.sum()), d), dtype) for _ in range(2))
    for t in (k, v):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    per = 2 * hkv * d * dtype.itemsize
    return (lambda: decode_attention(q, k, v, offs, lens, d**-0.5)), b * ctx * per, per


def latent_path() -> str:
    """The latent kernel's path: AMX tiles on the AMX level (bf16 cache), else the attention ISA's."""
    return cpu_kernels.kernel_backend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=7, help="kernel / probe alternations per case")
    ap.add_argument("--quick", action="store_true", help="one small case per shape")
    ap.add_argument("--cases", help="sequences x context to run, comma-separated (e.g. 256x117); default: all")
    ap.add_argument("--threads", type=int, help="threads for the kernels and the probe (default: torch's)")
    ap.add_argument("--isa", choices=("amx", "avx512bf16", "avx512", "avx2"),
                    help="run the kernels at this ISA level (default: the best this CPU has)")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa and (cpu_kernels.kernel_backend() == "torch" or torch.ops.moelight.set_isa(args.isa) != args.isa):
        ap.error(f"--isa {args.isa}: this CPU (or build) has no {args.isa} kernels")
    cases = [(32, 128)] if args.quick else CASES
    if args.cases:
        try:
            cases = [(int(b), int(c)) for b, c in (case.split("x") for case in args.cases.split(","))]
        except ValueError:
            ap.error(f"--cases {args.cases!r}: give sequences x context pairs, comma-separated, e.g. 256x117,16x2048")
    pairs = 2 if args.quick else args.pairs
    bufs, evict = probe_buffers(), torch.ones(2**26)
    rows = []
    for b, ctx in cases:
        for name, shape in SHAPES.items():
            fn, nbytes, per = case(shape, b, ctx, torch.bfloat16)
            r = paired_bandwidth(fn, nbytes, bufs, evict, pairs)
            t = cold_time(fn, 3, evict)
            rows.append((b, ctx, name, per, t, r))
            print(f"B={b} ctx={ctx} {name}: {per} B/token, {t * 1e3:.2f} ms, {r['ours_gbs']:.2f} GB/s, "
                  f"{r['ratio']:.2f} of the read bandwidth ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f})", flush=True)
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    flags = f" --isa {args.isa}" if args.isa else ""
    lines = ["# Latent (MLA) decode attention against GQA at equal context (bf16 cache)", "",
             f"`python benchmarks/bench_latent_attention.py{flags}` at {commit()}, {cpu}, "
             f"{torch.get_num_threads()} threads "
             f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}), torch {torch.__version__}, "
             f"{platform.python_version()}; latent kernel {latent_path()}, GQA kernel {cpu_kernels.kernel_backend()}; "
             f"read bandwidth now {read_bw_now(bufs):.1f} GB/s", "",
             "| sequences x context | kernel | bytes / token / layer | time (ms) | GB/s | share of read bandwidth "
             "(median, min-max of pairs) |", "|---|---|---|---|---|---|"]
    for b, ctx, name, per, t, r in rows:
        lines.append(f"| {b} x {ctx} | {name} | {per:,} | {t * 1e3:.2f} | {r['ours_gbs']:.2f} | "
                     f"{r['ratio']:.2f} ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f}) |")
    emit(lines, args.output)


if __name__ == "__main__":
    main()
