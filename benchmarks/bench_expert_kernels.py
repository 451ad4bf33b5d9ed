"""The fused expert kernel against the per-expert oneDNN loop, and against its roofs.

For each family's expert shape (bench-1b's Mixtral shape, bench-qwen3-moe's 128 narrow experts,
bench-gpt-oss's, OLMoE-1B-7B's real one), rows per layer call (T = 1, 8, 256 tokens: decode at batch
1 and 8, the README job's micro-batch) and weight format (bf16; int8 and int4 on the fused kernel),
it times one MoE layer's routed experts:
- `loop`: today's path, one oneDNN-packed matmul per touched expert (bf16 only),
- `fused-<isa>`: cpu_kernels.expert_mix on each ISA this CPU has.
Timings alternate between all formats and variants of a shape and T, best of --repeat, so a change
of host state hits all of them. Each call shifts the routing to other experts (expert e -> e + call
x top-k), so a call reads weights the previous calls did not: cold, as each layer of a decode step
reads them. Without it a T = 1 call would re-read the few experts the last one left in the L3 cache
(2 int4 experts of bench-1b are 12 MB) and time the cache, not the memory a decode step streams from.
Each fused ISA reads its own copy of the packed weights: the shift comes back to the same experts
every E / top-k calls (8 on OLMoE and gpt-oss: a round of the 7 variants plus one), so with one copy
fused-avx512bf16 re-read the experts fused-amx had read a round before, which a 480 MB L3 may still
hold (a T = 1 round reads ~450 MB on OLMoE).
The roofs are measured in the same run: the GEMM roof is oneDNN's bf16 FLOP/s at 1024 rows
(`moelight profile`'s probe), the bandwidth roof a streaming read of 256 MiB; a kernel's share of
its roof is the larger of FLOPs / (time x GEMM roof) and weight bytes read / (time x bandwidth).

    python benchmarks/bench_expert_kernels.py --repeat 7 --output benchmarks/results/expert_kernels.md
    python benchmarks/bench_expert_kernels.py --quick          # a check that it runs (~1 minute)
    python benchmarks/bench_expert_kernels.py --isas avx512 avx2   # AVX-512 without bf16 against AVX2

~10 minutes on two cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from markdown_report import emit  # noqa: E402

from cpu_kernels import dispatch, kernel_backend  # noqa: E402
from cpu_kernels.expert_pack import PackedExperts, bf16_matrix, pack_experts  # noqa: E402
from cpu_kernels.expert_quant import int4_group_for, quantize  # noqa: E402
from moelight.models.moe import expert_mix  # noqa: E402
from moelight.profiling.machine_profile import measure_gemm_curve  # noqa: E402
from moelight.runtime.cpu_linear import pack_weight, packed_linear, packing_supported, upcast_packed_linear  # noqa: E402
from moelight.runtime.fused_experts import on_huge_pages  # noqa: E402

# name, experts, top-k, hidden, expert width
SHAPES = [("bench-1b (Mixtral)", 8, 2, 1024, 3584), ("bench-qwen3-moe", 128, 8, 1024, 224),
          ("bench-gpt-oss", 32, 4, 1024, 896), ("olmoe-1b-7b", 64, 8, 2048, 1024)]
ISAS = ("amx", "avx512bf16", "avx512", "avx2")  # avx512: AVX2's kernels plus VNNI's int8-activation products


def _best(fns: dict, repeat: int, ids: torch.Tensor, experts: int) -> dict[str, float]:
    """Best time of each variant fn(ids); call c routes to ids shifted by c x top-k experts (cold
    weights), the same shift for every variant in a round."""
    times = {k: float("inf") for k in fns}
    calls = 0
    for _ in range(repeat):
        for k, fn in fns.items():
            shifted = (ids + calls * ids.shape[1]) % experts
            calls += 1
            t0 = time.perf_counter()
            fn(shifted)
            times[k] = min(times[k], time.perf_counter() - t0)
    return times


def _copy(p: PackedExperts) -> PackedExperts:
    """The same packed weights in memory of their own, on huge pages where the engine puts them
    (fused_experts.on_huge_pages): at T = 1 a call streams them, ~1.2x as fast as from 4 KiB pages."""
    tensors = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    return on_huge_pages(dataclasses.replace(
        p, **{n: t.clone() for n, t in tensors.items() if isinstance(t, torch.Tensor)}))


def _read_bandwidth() -> float:
    buf = torch.ones(64 * 2**20, dtype=torch.float32)
    return buf.numel() * 4 / min(_timed(buf.sum) for _ in range(5))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="one shape, fewer repeats")
    ap.add_argument("--output", type=Path)
    ap.add_argument("--isas", nargs="+", choices=ISAS, default=["amx", "avx512bf16", "avx2"],
                    help="kernel ISAs to time, where the CPU has them")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 256], help="rows per layer call (T)")
    a = ap.parse_args()
    dispatch.kernel_backend()
    isas = [i for i in a.isas if kernel_backend() != "torch" and torch.ops.moelight.set_isa(i) == i]
    torch.ops.moelight.set_isa("auto")
    gemm_roof = max(f for _, f in measure_gemm_curve(torch.bfloat16, rows=(1024,), pool_bytes=48 * 2**20))
    lines = [f"Host: torch {torch.__version__}, ISAs {', '.join(isas)}; GEMM roof {gemm_roof / 1e12:.2f} TFLOP/s "
             "(the engine's bf16 GEMM, 1024 rows)\n",
             "| shape | T | format | variant | ms | GFLOP/s | GB/s of weights | bandwidth probe GB/s | "
             "share of roof | fused / loop |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e, k, h, f in SHAPES[:1] if a.quick else SHAPES:
        g = torch.Generator().manual_seed(0)
        w13, w2 = torch.randn(e, 2 * f, h, generator=g) * 0.02, torch.randn(e, h, f, generator=g) * 0.02
        # the engine's loop: packed bf16, or packed float32 copies where oneDNN packs no bf16 (cpu_linear)
        native = packing_supported(torch.bfloat16)
        loop_mm = packed_linear if native else upcast_packed_linear
        loop13 = [pack_weight(w.to(torch.bfloat16) if native else w.to(torch.bfloat16).float()) for w in w13]
        loop2 = [pack_weight(w.to(torch.bfloat16) if native else w.to(torch.bfloat16).float()) for w in w2]
        group = int4_group_for(h, f)
        packs = {"bf16": on_huge_pages(pack_experts(bf16_matrix(w13), bf16_matrix(w2)))}
        for fmt in ("int8", "int4"):
            packs[fmt] = on_huge_pages(pack_experts(quantize(w13, fmt, group), quantize(w2, fmt, group)))
        copies = {(fmt, isa): _copy(p) for fmt, p in packs.items() for isa in isas[1:]}
        for t in [t for t in a.tokens if t <= 8] if a.quick else a.tokens:
            x = torch.randn(t, h, generator=g).to(torch.bfloat16)
            weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g), -1), k, dim=-1)
            touched = len(torch.unique(ids))
            flops = 6.0 * h * f * t * k
            fns = {}  # every format and variant of this shape and T, alternated
            for fmt, p in packs.items():
                if fmt == "bf16":
                    fns[fmt, "loop"] = (lambda i, x=x, w=weights, a=loop13, b=loop2, mm=loop_mm:
                                        expert_mix(x, w, i, a, b, mm))
                for isa in isas:
                    def run(i, isa=isa, x=x, w=weights, p=copies.get((fmt, isa), p)):
                        torch.ops.moelight.set_isa(isa)
                        dispatch.expert_mix(x, i, w, p)
                    fns[fmt, f"fused-{isa}"] = run
            bw = _read_bandwidth()
            times = _best(fns, 2 if a.quick else a.repeat, ids, e)
            for (fmt, variant), s in times.items():
                weight_bytes = packs[fmt].nbytes() * touched / e
                share = max(flops / s / gemm_roof, weight_bytes / s / bw)
                loop = times.get((fmt, "loop"))
                ratio = f"{loop / s:.2f}x" if loop and variant != "loop" else "–"
                lines.append(f"| {name} | {t} | {fmt} | {variant} | {s * 1e3:.2f} | {flops / s / 1e9:.0f} | "
                             f"{weight_bytes / s / 1e9:.1f} | {bw / 1e9:.1f} | {100 * share:.0f}% | {ratio} |")
        torch.ops.moelight.set_isa("auto")
    emit(lines, a.output)


if __name__ == "__main__":
    main()
