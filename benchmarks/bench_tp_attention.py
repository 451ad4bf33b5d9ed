"""How tensor-parallel ranks should share the CPU attention (computed once, not N times).

Two ways, each timed per (layer, micro-batch) call over N processes joined by gloo, as the
emulated devices run:
- split: each rank keeps the KV cache of its own KV heads and attends its own query heads on
  its share of the host's cores (cores / N threads), all ranks at once;
- host worker: rank 0 keeps the whole cache; the ranks send it their q / k / v (a gather),
  it attends every head on all the cores, and sends each rank its heads' output (a scatter).

    python benchmarks/bench_tp_attention.py [--ranks 2] [--mu 64] [--ctx 256] [--repeats 30]

Prints a markdown table (milliseconds per call, median and min over the repeats).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"bench-1b (16/4 heads, d 64)": (16, 4, 64), "Mixtral (32/8 heads, d 128)": (32, 8, 128)}


def _cache(hkv: int, mu: int, ctx: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of mu sequences of ctx keys, packed per KV head in the engine's [Hkv, T, d] layout."""
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(hkv, mu * ctx, d, generator=g).to(dtype) for _ in range(2))


def _rank(rank: int, world: int, port: int, mu: int, ctx: int, dtype_name: str, repeats: int, out) -> None:
    from cpu_kernels import decode_attention

    dtype = getattr(torch, dtype_name)
    cores = os.cpu_count() or 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for label, (hq, hkv, d) in SHAPES.items():
        offsets = torch.arange(mu) * ctx
        lengths = torch.full((mu,), ctx)
        scale = d**-0.5
        # split: this rank's heads only
        torch.set_num_threads(max(1, cores // world))
        k, v = _cache(hkv // world, mu, ctx, d, dtype)
        q = torch.randn(mu, hq // world, d).to(dtype)
        split = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            decode_attention(q, k, v, offsets, lengths, scale)
            dist.barrier()
            split.append(time.perf_counter() - t0)
        del k, v
        # host worker: rank 0 holds every head
        torch.set_num_threads(cores if rank == 0 else 1)
        if rank == 0:
            k, v = _cache(hkv, mu, ctx, d, dtype)
        part = torch.randn(mu, (hq + 2 * hkv) // world, d).to(dtype)  # this rank's q, new k, new v
        worker = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            parts = [torch.empty_like(part) for _ in range(world)] if rank == 0 else None
            dist.gather(part, parts, dst=0)
            outs = [torch.empty(mu, hq // world, d, dtype=dtype) for _ in range(world)] if rank == 0 else None
            mine = torch.empty(mu, hq // world, d, dtype=dtype)
            if rank == 0:
                qs = torch.cat([p[:, : hq // world] for p in parts], 1)
                full = decode_attention(qs, k, v, offsets, lengths, scale)
                outs = list(full.chunk(world, 1))
                outs = [o.contiguous() for o in outs]
            dist.scatter(mine, outs, src=0)
            dist.barrier()
            worker.append(time.perf_counter() - t0)
        rows.append((label, split, worker))
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mu", type=int, default=64, help="sequences per micro-batch")
    ap.add_argument("--ctx", type=int, default=256, help="keys per sequence")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = mp.get_context("spawn").Queue()
    ctx = mp.start_processes(_rank, args=(a.ranks, port, a.mu, a.ctx, a.dtype, a.repeats, q), nprocs=a.ranks,
                             join=False, start_method="spawn")
    rows = q.get(timeout=600)
    ctx.join()
    print(f"\n{a.ranks} ranks on {os.cpu_count()} cores, mu {a.mu}, ctx {a.ctx}, {a.dtype}, "
          f"{a.repeats} calls each (ms per call: median / min)\n")
    print("| shape | split heads across ranks | one host worker (gather, attend, scatter) | worker / split |")
    print("|---|---|---|---|")
    for label, split, worker in rows:
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.2f} / {min(xs) * 1e3:.2f}"  # noqa: E731
        print(f"| {label} | {ms(split)} | {ms(worker)} | {statistics.median(worker) / statistics.median(split):.2f} |")


if __name__ == "__main__":
    main()
