"""Hardware presets: single GPUs (with a generic host) and the paper's settings S1-S9.

GPU and link numbers are rates real kernels and copies achieve, each with its published
source or its derivation in the comments (the datasheet peaks sit beside them); a
`moelight profile` on the machine itself replaces them. The paper's hosts are GCP VMs;
their CPU numbers are derived in the comments, as the paper's Table 2 gives only clock,
core count and memory.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hrm.hardware import GB, TFLOPS, GiB, HardwareSpec, Level, Link

DEFAULT_PROFILE_PATH = Path("~/.cache/moelight/hardware.json")

# ---- GPUs (per device), as achieved ----
# Every rate below is what real kernels reach, each with its source; the datasheet peak is kept
# beside it (`*_DATASHEET`) for roofline plots and for comparison (BENCHMARKS.md section 10 shows
# the Table 5 prediction under both). Sources:
# [J19] Jia et al., "Dissecting the NVidia Turing T4 GPU via Microbenchmarking", arXiv:1903.07486:
#       T4 global memory reaches 220 GB/s of 320 (68.8%).
# [NF]  NVIDIA developer forum, "About GPU peak performance" (2023): cuBLAS FP16 4096^3 on a T4
#       sustains ~24 TFLOPS; the 70 W power cap lowers the clock under continuous matmuls.
# [FG]  FlexGen (Sheng et al., ICML'23), cost_model.py, CostModelConfig "aligned on google cloud
#       T4", constants fitted to measured FlexGen runs on a GCP T4 VM (the paper's S1 cloud):
#       CPU->GPU 12.89 GB/s; prefill matmul 21.24 TFLOPS; decode matmul 4.3 TFLOPS at FlexGen's
#       GPU batch of 48 rows (OPT-30B suite) = 48 FLOP per weight byte in fp16, i.e. the weights
#       stream at 4.3e12 / 48 = 89.6 GB/s; prefill attention 9.97 TFLOPS; decode attention on the
#       GPU 79 GFLOPS at 1 FLOP per KV byte (fp16: 4d FLOPs per 4d bytes per key), i.e. 79 GB/s.
# [NC]  NCCL's PCIe table (src/graph/topo.cc kvDictPciGen, "x100 Mbps per lane", after protocol
#       overhead): Gen3 60 -> 0.75 GB/s per lane, 12 GB/s at x16; Gen4 24 GB/s; Gen5 48 GB/s.
#       Measured alike: P100 Gen3 bandwidthTest 12.15 GB/s H2D / 12.89 D2H pinned (gearshifft #82);
#       RTX 4090 Gen4 nvbandwidth 24-26 GB/s; A100 Gen4 "25 GB/s measured peak" (BaM #54).
# [PG]  Pageable copies: the driver bounces them through its own pinned buffer (a host memcpy, then
#       the DMA, partly overlapped): on Gen4 64 MiB pageable H2D 12.9 GB/s vs 23.9 pinned, D2H
#       at 16 MiB 12.3 vs 26.6 (NVlabs/cuda-oxide #976, RTX 4090). Gen3 at the same ratio: ~6.5 GB/s.
# [LT]  Fixed cost per copy (issue + DMA setup + completion): 10 us, an assumption of the order of a
#       kernel launch (`moelight profile` measures it from small copies).
# [LO]  Per layer pass of one micro-batch in eager PyTorch: ~50 kernels (norms, projections,
#       rotary, router, top-k, per-expert gather / 3 GEMMs / activation / scatter) at ~10 us of
#       launch and dispatch each: 0.5 ms, derived (`moelight profile` measures it).
# [L4M] NVIDIA L4 on a physical host, torch matmul (zzc0721/torch-performance-test-data #120):
#       FP16 53.0 TFLOPS at 4096^2, 53.8 at 8192^2; FP32 12.5 at 4096^2 (the 72 W cap, as on T4).
# [JC]  A100-40GB memcopy 1355 GB/s of 1555 (87%) (PTsolvers/gpu-workshop-JuliaCon23 #7);
#       A800-80GB-PCIe torch FP16 matmul 215 TFLOPS at n=8192 (mli/transformers-benchmarks #4);
#       H100 cuBLAS 518.6 TFLOPS at 8192 (pranjalssh/fast.cu #13); H100 NVLink4 ~380 GB/s per
#       direction of 450 (NVIDIA/nccl #1264).
# Derived, not measured (said where used): L4 memory at T4's GDDR6 efficiency (68.8% of 300 GB/s);
# L4's small-M GEMM and GPU attention rates at T4's ratios to its achieved bandwidth (0.407, 0.359);
# A100-80GB / H100 memory at A100-40GB's 87%; A100 NVLink at H100's 84%.
T4_DATASHEET = Level("T4", 16 * GiB, 320 * GB, {"float32": 8.1 * TFLOPS, "float16": 65 * TFLOPS,
                                                 "bfloat16": 8.1 * TFLOPS, "int8": 130 * TFLOPS})
_T4_SUSTAINED = 21.24 / 65  # [FG] prefill matmul / FP16 tensor peak: the clock the 70 W cap leaves
T4 = Level("T4", 16 * GiB, 220 * GB,  # [J19]
           # Turing has no bf16 tensor cores: bf16 runs at the FP32 rate; FP32 at the sustained clock
           {"float32": 8.1 * TFLOPS * _T4_SUSTAINED, "float16": 21.24 * TFLOPS,  # [FG], [NF] ~24
            "bfloat16": 8.1 * TFLOPS * _T4_SUSTAINED, "int8": 130 * TFLOPS * _T4_SUSTAINED},
           attention_bandwidth=79 * GB, attention_flops={"float16": 9.97 * TFLOPS},  # [FG]
           layer_overhead_s=0.5e-3, gemm_bandwidth=89.6 * GB)  # [LO], [FG]
# PCIe Gen3 x16 [NC]; H2D as FlexGen measured on the GCP T4 [FG]
T4_LINK = Link(h2d=12.89 * GB, d2h=12.0 * GB, pageable_h2d=6.5 * GB, pageable_d2h=6.0 * GB, latency_s=10e-6)
T4_LINK_DATASHEET = Link(h2d=16 * GB, d2h=16 * GB)

L4_DATASHEET = Level("L4", 24 * GiB, 300 * GB, {"float32": 30.3 * TFLOPS, "float16": 121 * TFLOPS,
                                                 "bfloat16": 121 * TFLOPS, "int8": 242.5 * TFLOPS})
_L4_BW = 300 * GB * 220 / 320  # derived: GDDR6 at T4's measured efficiency [J19]
L4 = Level("L4", 24 * GiB, _L4_BW,
           {"float32": 12.5 * TFLOPS, "float16": 53.0 * TFLOPS, "bfloat16": 53.0 * TFLOPS,  # [L4M]
            "int8": 242.5 * TFLOPS * 53.0 / 121},
           attention_bandwidth=_L4_BW * 79 / 220, attention_flops={"float16": 53.0 * TFLOPS * 9.97 / 21.24,
                                                                   "bfloat16": 53.0 * TFLOPS * 9.97 / 21.24},
           layer_overhead_s=0.5e-3, gemm_bandwidth=_L4_BW * 89.6 / 220)  # derived from T4's ratios
L4_LINK = Link(h2d=24 * GB, d2h=24 * GB, pageable_h2d=12.9 * GB, pageable_d2h=12.3 * GB,
               latency_s=10e-6)  # Gen4 x16 [NC], [PG]
L4_LINK_DATASHEET = Link(h2d=32 * GB, d2h=32 * GB)

# A100 (SXM): datasheet 40 GB HBM2 1555 GB/s, 80 GB HBM2e 2039 GB/s, BF16/FP16 312 TFLOPS dense,
# FP32 19.5, INT8 624; PCIe Gen4 x16; NVLink 3 600 GB/s bidirectional. Achieved per [JC].
_A100_SUSTAINED = 215 / 312
_A100_FLOPS = {"float32": 19.5 * TFLOPS * _A100_SUSTAINED, "float16": 215 * TFLOPS, "bfloat16": 215 * TFLOPS,
               "int8": 624 * TFLOPS * _A100_SUSTAINED}
A100_40 = Level("A100-40GB", 40 * GiB, 1355 * GB, dict(_A100_FLOPS), layer_overhead_s=0.5e-3)
A100_80 = Level("A100-80GB", 80 * GiB, 2039 * GB * 0.87, dict(_A100_FLOPS), layer_overhead_s=0.5e-3)
A100_LINK = Link(h2d=24 * GB, d2h=24 * GB, pageable_h2d=12.9 * GB, pageable_d2h=12.3 * GB, latency_s=10e-6)
A100_NVLINK = 300 * GB * 380 / 450  # derived: H100's achieved share of NVLink [JC]

# H100 SXM5: datasheet 80 GB HBM3 3.35 TB/s, BF16/FP16 989.5 TFLOPS dense, FP32 67, INT8 1979;
# PCIe Gen5 x16; NVLink 4 900 GB/s bidirectional. Achieved per [JC], memory at A100's 87%.
_H100_SUSTAINED = 518.6 / 989.5
H100 = Level("H100-80GB", 80 * GiB, 3350 * GB * 0.87,
             {"float32": 67 * TFLOPS * _H100_SUSTAINED, "float16": 518.6 * TFLOPS, "bfloat16": 518.6 * TFLOPS,
              "int8": 1979 * TFLOPS * _H100_SUSTAINED}, layer_overhead_s=0.5e-3)
H100_LINK = Link(h2d=48 * GB, d2h=48 * GB, pageable_h2d=25 * GB, pageable_d2h=25 * GB, latency_s=10e-6)
H100_NVLINK = 380 * GB  # [JC]
# A100 / H100 have no published small-M GEMM or attention rates here: those default to the achieved
# memory bandwidth (an upper bound a `moelight profile` on the machine replaces).
# T4 and L4 have no NVLink: their all-reduces cross PCIe (HardwareSpec.interconnect = 0).
# Every preset gives each GPU its own x16 link (`link_shared=False`), as the paper's multi-T4
# VMs do; a host whose GPUs sit behind one switch uplink is a profile JSON with "link_shared": true
# (or `moelight plan --shared-link`). Ring all-reduce step latency: HardwareSpec's 5 us default, an
# assumption of the order of NCCL's small-message latency, not a measurement.

# ---- CPU hosts ----
# Decode attention on the CPU: moelight's kernel (cpu_kernels) reads the KV cache at 80-86% of a
# plain read's bandwidth at the paper's shapes (BENCHMARKS.md section 2): 0.8 x the host's bandwidth.
_CPU_ATTENTION_SHARE = 0.8
# Dispatch per layer pass on the CPU: the same eager PyTorch ops as on a GPU, [LO]'s 0.5 ms.
_CPU_LAYER_OVERHEAD_S = 0.5e-3
# S1 / S6-S9: GCP N1 VMs with T4s; 2.30 GHz is the N1 Haswell (Xeon E5-2699 v3 class) clock.
# "24-core, 192 GB" = 48 vCPUs (24 physical cores, 2 hyper-threads each).
# FP32 peak: 24 cores x 2.3 GHz x 32 FLOP/cycle (2 AVX2 FMA units x 8 lanes x 2) = 1.77 TFLOPS.
# No bf16 units: bf16 kernels convert to fp32, so bf16 = fp32 rate (an upper bound).
# Memory bandwidth: a 48-vCPU N1 VM spans both sockets of the host; each Haswell socket has
# 4 channels of DDR4-2133 = 68 GB/s, 136 GB/s per host; STREAM reaches ~75% of that, and the
# VM has most but not all of the cores, so we take 100 GB/s.
XEON_N1_24 = Level("Xeon-2.3GHz-24c", 192 * GiB, 100 * GB,
                   {"float32": 1.77 * TFLOPS, "bfloat16": 1.77 * TFLOPS, "float16": 1.77 * TFLOPS},
                   attention_bandwidth=_CPU_ATTENTION_SHARE * 100 * GB, layer_overhead_s=_CPU_LAYER_OVERHEAD_S)
# S2: GCP G2 (L4) VMs run Cascade Lake at 2.20 GHz; g2-standard-48 = 48 vCPUs / 192 GB.
# FP32 peak: 24 cores x 2.2 GHz x 64 FLOP/cycle (2 AVX-512 FMA units x 16 lanes x 2) = 3.38 TFLOPS.
# Bandwidth: 6 channels DDR4-2933 = 140.8 GB/s per socket; the VM holds about one socket's worth
# of cores; at ~80% STREAM efficiency we take 110 GB/s.
XEON_G2_24 = Level("Xeon-2.2GHz-24c", 192 * GiB, 110 * GB,
                   {"float32": 3.38 * TFLOPS, "bfloat16": 3.38 * TFLOPS, "float16": 3.38 * TFLOPS},
                   attention_bandwidth=_CPU_ATTENTION_SHARE * 110 * GB, layer_overhead_s=_CPU_LAYER_OVERHEAD_S)
# S6-S9: "32-core, 416 GB" = n1-highmem-64 (64 vCPUs, 416 GB), Haswell 2.3 GHz, both sockets:
# 32 x 2.3 GHz x 32 = 2.36 TFLOPS FP32; 2 sockets x 68 GB/s = 136 GB/s peak, ~75% -> 100 GB/s
# (the VM covers the whole host, so a little more than the 24-core VM: 110 GB/s).
XEON_N1_32 = Level("Xeon-2.3GHz-32c", 416 * GiB, 110 * GB,
                   {"float32": 2.36 * TFLOPS, "bfloat16": 2.36 * TFLOPS, "float16": 2.36 * TFLOPS},
                   attention_bandwidth=_CPU_ATTENTION_SHARE * 110 * GB, layer_overhead_s=_CPU_LAYER_OVERHEAD_S)
# Generic host for the bare GPU presets: 2-socket server, 512 GB, 8-channel DDR4-3200 per
# socket (204.8 GB/s/socket -> ~300 GB/s usable), 64 cores x 2.5 GHz x 64 FLOP/cycle = 10 TFLOPS.
GENERIC_HOST = Level("server-64c", 512 * GiB, 300 * GB,
                     {"float32": 10 * TFLOPS, "bfloat16": 10 * TFLOPS, "float16": 10 * TFLOPS},
                     attention_bandwidth=_CPU_ATTENTION_SHARE * 300 * GB, layer_overhead_s=_CPU_LAYER_OVERHEAD_S)

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "t4": HardwareSpec("t4", GENERIC_HOST, T4, 1, T4_LINK, "T4 16GB + generic 512GB host"),
    "l4": HardwareSpec("l4", GENERIC_HOST, L4, 1, L4_LINK, "L4 24GB + generic 512GB host"),
    "a100-40gb": HardwareSpec("a100-40gb", GENERIC_HOST, A100_40, 1, A100_LINK, "A100 40GB + generic host",
                              interconnect=A100_NVLINK),
    "a100-80gb": HardwareSpec("a100-80gb", GENERIC_HOST, A100_80, 1, A100_LINK, "A100 80GB + generic host",
                              interconnect=A100_NVLINK),
    "h100": HardwareSpec("h100", GENERIC_HOST, H100, 1, H100_LINK, "H100 80GB SXM + generic host",
                         interconnect=H100_NVLINK),
    "s1": HardwareSpec("s1", XEON_N1_24, T4, 1, T4_LINK, "paper S1: 1xT4, Xeon 2.3GHz 24-core, 192GB"),
    "s2": HardwareSpec("s2", XEON_G2_24, L4, 1, L4_LINK, "paper S2: 1xL4, Xeon 2.2GHz 24-core, 192GB"),
    "s6": HardwareSpec("s6", XEON_N1_32, T4, 2, T4_LINK, "paper S6 (Mixtral 8x22B): 2xT4, 32-core, 416GB"),
    "s7": HardwareSpec("s7", XEON_N1_32, T4, 4, T4_LINK, "paper S7 (Mixtral 8x22B): 4xT4, 32-core, 416GB"),
    "s8": HardwareSpec("s8", XEON_N1_32, T4, 2, T4_LINK, "paper S8 (DBRX): 2xT4, 32-core, 416GB"),
    "s9": HardwareSpec("s9", XEON_N1_32, T4, 4, T4_LINK, "paper S9 (DBRX): 4xT4, 32-core, 416GB"),
    "cpu-server": HardwareSpec("cpu-server", GENERIC_HOST, None, 0, None, "CPU-only generic server"),
}


_DATASHEET = {"T4": (T4_DATASHEET, T4_LINK_DATASHEET), "L4": (L4_DATASHEET, L4_LINK_DATASHEET)}


def datasheet_variant(hw: HardwareSpec) -> HardwareSpec:
    """The same host with its T4 / L4 at datasheet peaks and links at the PCIe line rate, as the
    HRM's roofs stood before achieved rates (for comparisons); other hardware is returned as is."""
    if not hw.has_gpu or hw.gpu.name not in _DATASHEET:
        return hw
    gpu, link = _DATASHEET[hw.gpu.name]
    return replace(hw, name=f"{hw.name}-datasheet", gpu=gpu, link=link,
                   cpu=replace(hw.cpu, attention_bandwidth=0.0))


def list_hardware() -> list[str]:
    return sorted(HARDWARE_PRESETS)


def get_hardware(name: str, profile_path: str | Path | None = None) -> HardwareSpec:
    """A preset by name, 'profile' for the cached measurement, or a path to a profile JSON."""
    key = name.lower()
    if key in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[key]
    if key == "profile":
        return HardwareSpec.load(profile_path or DEFAULT_PROFILE_PATH)
    if key.endswith(".json") or Path(name).expanduser().is_file():
        return HardwareSpec.load(name)
    raise KeyError(f"unknown hardware {name!r}; valid: {', '.join(list_hardware())}, profile, or a JSON path")
