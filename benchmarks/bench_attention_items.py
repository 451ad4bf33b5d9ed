"""Decode attention: share of read bandwidth against the length of a work item, same bytes.

A work item is one (sequence, KV head). B x ctx is held constant, so every case reads the same
KV bytes and only the number of items changes. One thread, timed against a one-thread read
in alternation (median of the paired ratios), every call after an L3-evicting read. A falling
share with shorter items is a fixed cost per item; see BENCHMARKS.md §2.

    python benchmarks/bench_attention_items.py   # writes benchmarks/results/attention_items.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import HKV, HQ, D, decode_case, paired_bandwidth, probe_buffers  # noqa: E402

import cpu_kernels  # noqa: E402

SHAPES = [(64, 2048), (256, 512), (1024, 128)]  # B x ctx = 131072 keys per KV head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention_items.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = cpu_kernels.kernel_backend()
    buf = probe_buffers()
    evict = torch.ones(2**25, dtype=torch.float32)
    rows = ["| dtype | B | ctx (keys per item) | items | KV MiB | ours GB/s | read BW now | % of read BW (range) |",
            "|---|---|---|---|---|---|---|---|"]
    for dt in args.dtypes:
        for b, ctx in SHAPES:
            case = decode_case(b, ctx, getattr(torch, dt))
            kv_bytes = case["kv_bytes"]
            r = paired_bandwidth(lambda c=case: cpu_kernels.decode_attention(*c["args"]), kv_bytes, buf, evict,
                                 args.pairs)
            line = (f"| {dt} | {b} | {ctx} | {b * HKV} | {kv_bytes / 2**20:.0f} | {r['ours_gbs']:.1f} "
                    f"| {r['bw_now']:.1f} | {100 * r['ratio']:.0f}% ({100 * r['ratio_lo']:.0f}–"
                    f"{100 * r['ratio_hi']:.0f}) |")
            print(line, flush=True)
            rows.append(line)
            del case
    md = ["# Decode attention: item length at equal bytes (one thread)", "",
          f"## Run of {time.strftime('%Y-%m-%d %H:%M')}", "",
          f"Command: `python {' '.join(sys.argv)}`", "",
          f"Backend `{backend}`, 1 thread, torch {torch.__version__}. Hq={HQ}, Hkv={HKV}, d={D}.", "",
          *rows, ""]
    Path(args.out).write_text("\n".join(md))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
