"""Decode attention over a packed KV cache against the engine's layout, free slots after each block.

The engine gives each sequence prompt + max-new-tokens slots (moelight.runtime.kv_cache, slot_pool),
so while it decodes, every (sequence, KV head) block is followed by the slots it has not yet
filled; bench_attention.py times packed blocks. Same kernel, same keys and values:
each pair times the two layouts in alternating order, each call after an L3-evicting read,
with a read-bandwidth probe before each pair labelling the host's state. Reports the median
time ratio slack / packed (> 1: the gaps cost time), overall and per host state.

    OMP_WAIT_POLICY=passive python benchmarks/ab_kv_slack.py --out benchmarks/results/attention_kv_slack.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ab_kv_pages import HIGH_STATE_GBS, paired, ratio_cells  # noqa: E402
from bench_attention import HKV, HQ, D, decode_case, mtbench_like_lengths, parse_case, probe_buffers  # noqa: E402

import cpu_kernels  # noqa: E402

ENGINE_LAYOUTS = ("facing", "token-major")


def engine_case(slack: int, layout: str = "head-major") -> dict:
    """The README job's decode attention (model bench-1b: Hq=16, Hkv=4, d=64, bf16): 256
    sequences of MT-Bench-like prompt lengths with 32 tokens generated, each region followed
    by `slack` free slots (32: half of gen 64 still to come). Layouts of the same keys:
    "head-major" is the engine's [Hkv, T, d]; "facing" pairs regions so that the second of
    each pair is stored newest-first and ends where the next pair starts (decode attention does
    not depend on key order): half the gaps; "token-major" stores [T, Hkv, d] and passes the
    kernel its [Hkv, T, d] view (one gap per sequence, but each item reads strided rows)."""
    from moelight.runtime.host_memory import empty_huge

    b, hq, hkv, d, generated = 256, 16, 4, 64, 32
    gen = torch.Generator().manual_seed(0)
    prompts = mtbench_like_lengths(b, gen)
    lens = prompts + generated
    caps = lens + slack
    offs = torch.cumsum(caps, 0) - caps
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    slots = torch.repeat_interleave(offs, lens) + pos
    if layout == "facing":  # odd sequences: newest-first, flush with their region's end
        odd = torch.arange(b) % 2 == 1
        ends = offs + caps
        slots = torch.where(torch.repeat_interleave(odd, lens), torch.repeat_interleave(ends - 1, lens) - pos, slots)
        offs = torch.where(odd, ends - lens, offs)
    total = int(caps.sum())
    if layout == "token-major":
        k, v = (empty_huge((total, hkv, d), torch.bfloat16).transpose(0, 1) for _ in range(2))
    else:
        k, v = (empty_huge((hkv, total, d), torch.bfloat16) for _ in range(2))
    for t in (k, v):  # the same keys and values whatever the layout
        t[:, slots] = torch.randn(hkv, len(slots), d, generator=gen).bfloat16()
    q = torch.randn(b, hq, d, generator=gen).bfloat16()
    label = f"| bfloat16 | {b} (bench-1b, ragged) | {prompts.float().mean():.0f} + {generated} (mean) | {slack} "
    return {"args": (q, k, v, offs, lens, d**-0.5), "kv_bytes": 2 * hkv * int(lens.sum()) * d * 2,
            "label": label}


def compare(label: str, packed: dict, gapped: dict, bufs, evict: torch.Tensor, pairs: int,
            exact: bool = True) -> str:
    """Checks both layouts give the same outputs (bit for bit unless the key order differs),
    then times them in pairs: one table row."""
    tol = {"atol": 0, "rtol": 0} if exact else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(cpu_kernels.decode_attention(*packed["args"]),
                               cpu_kernels.decode_attention(*gapped["args"]), **tol)
    # paired() labels its two arguments (small, huge): here A (packed or the engine's) and B.
    line = label + ratio_cells(paired(packed["args"], gapped["args"], bufs, evict, pairs), packed["kv_bytes"])
    print(line, flush=True)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=["64x512", "256x512", "256x128"], help="BxCTX")
    ap.add_argument("--slacks", nargs="+", type=int, default=[8, 64], help="free slots after each block")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--pairs", type=int, default=21)
    ap.add_argument("--engine-pairs", type=int, default=21,
                    help="pairs for the README job's own decode shapes (0: skip)")
    ap.add_argument("--engine-layouts", nargs="*", default=list(ENGINE_LAYOUTS), choices=ENGINE_LAYOUTS,
                    help="other layouts of the README job's cache, each timed against the engine's")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if any(x < 0 for x in args.slacks):
        ap.error("--slacks: free slots cannot be negative")
    bufs, evict = probe_buffers(), torch.ones(2**25)
    lines = ["| dtype | B | ctx | free slots | packed GB/s (median) | with slots GB/s (median) "
             f"| time slots / packed, all pairs | probe < {HIGH_STATE_GBS:.0f} GB/s "
             f"| probe ≥ {HIGH_STATE_GBS:.0f} GB/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dt in args.dtypes:
        for case in args.cases:
            b, ctx = parse_case(case)
            torch.manual_seed(0)
            packed = decode_case(b, ctx, getattr(torch, dt))
            for slack in args.slacks:
                gapped = decode_case(b, ctx, getattr(torch, dt), slack=slack)
                gapped["k4"].copy_(packed["k4"])  # the same keys and values in both layouts
                gapped["v4"].copy_(packed["v4"])
                gapped["args"] = (packed["q"], *gapped["args"][1:])
                lines.append(compare(f"| {dt} | {b} | {ctx} | {slack} ", packed, gapped, bufs, evict, args.pairs))
                del gapped
            del packed
    if args.engine_pairs:
        gapped = engine_case(32)
        lines.append(compare(gapped["label"], engine_case(0), gapped, bufs, evict, args.engine_pairs))
        for layout in args.engine_layouts:  # here the B side is the other layout, A the engine's
            other = engine_case(32, layout)
            lines.append(compare(gapped["label"] + f"({layout} / engine's) ", gapped, other, bufs, evict,
                                 args.engine_pairs, exact=layout != "facing"))
    if args.out:
        md = ["# Decode attention: packed KV blocks vs the engine's free slots after each block "
              "(paired, one process)", "",
              f"Command: `python {' '.join(sys.argv)}`", "",
              f"Backend `{cpu_kernels.kernel_backend()}`, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, Hq={HQ}, Hkv={HKV}, d={D}, {args.pairs} pairs per case; "
              "a free slot is one token row of K (and of V) per KV head. The bench-1b rows: the README job's "
              "decode attention (Hq=16, Hkv=4, d=64); in a row marked (layout / engine's) the two "
              "columns and the ratio are the engine's layout (A) and that layout (B), both with the free "
              "slots (see engine_case).", "", *lines, ""]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(md))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
