"""Hardware presets: single GPUs (with a generic host) and the paper's settings S1-S9.

GPU numbers are vendor datasheet peaks (dense, no sparsity). Link numbers are the
PCIe per-direction peak (datasheets quote the bidirectional sum). The paper's hosts
are GCP VMs; their CPU numbers are derived in the comments (peak, not measured), as
the paper's Table 2 gives only clock, core count and memory.
"""

from __future__ import annotations

from pathlib import Path

from hrm.hardware import GB, TFLOPS, GiB, HardwareSpec, Level, Link

DEFAULT_PROFILE_PATH = Path("~/.cache/moelight/hardware.json")

# ---- GPUs (per device) ----
# NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, FP32 8.1 TFLOPS, FP16 tensor (mixed) 65 TFLOPS,
# INT8 130 TOPS, PCIe Gen3 x16 "32 GB/s" interconnect (bidirectional -> 16 GB/s per direction).
# Turing has no bf16 tensor cores; bf16 matmuls run no faster than FP32, so bf16 = FP32 rate.
T4 = Level("T4", 16 * GiB, 320 * GB, {"float32": 8.1 * TFLOPS, "float16": 65 * TFLOPS,
                                       "bfloat16": 8.1 * TFLOPS, "int8": 130 * TFLOPS})
T4_LINK = Link(h2d=16 * GB, d2h=16 * GB)

# NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, FP32 30.3 TFLOPS, BF16/FP16 tensor 242 TFLOPS
# with sparsity -> 121 dense, INT8 485 TOPS sparse -> 242.5 dense; PCIe Gen4 x16 64 GB/s
# bidirectional -> 32 GB/s per direction.
L4 = Level("L4", 24 * GiB, 300 * GB, {"float32": 30.3 * TFLOPS, "float16": 121 * TFLOPS,
                                       "bfloat16": 121 * TFLOPS, "int8": 242.5 * TFLOPS})
L4_LINK = Link(h2d=32 * GB, d2h=32 * GB)

# NVIDIA A100 datasheet (SXM): 40 GB HBM2 1555 GB/s; 80 GB HBM2e 2039 GB/s; FP32 19.5 TFLOPS,
# BF16/FP16 tensor 312 TFLOPS dense, INT8 624 TOPS; PCIe Gen4 x16 (32 GB/s per direction).
_A100_FLOPS = {"float32": 19.5 * TFLOPS, "float16": 312 * TFLOPS, "bfloat16": 312 * TFLOPS,
               "int8": 624 * TFLOPS}
A100_40 = Level("A100-40GB", 40 * GiB, 1555 * GB, dict(_A100_FLOPS))
A100_80 = Level("A100-80GB", 80 * GiB, 2039 * GB, dict(_A100_FLOPS))
A100_LINK = Link(h2d=32 * GB, d2h=32 * GB)
# A100 SXM NVLink 3: 12 links, 600 GB/s bidirectional per GPU -> 300 GB/s per direction.
A100_NVLINK = 300 * GB

# NVIDIA H100 SXM5 datasheet: 80 GB HBM3 3.35 TB/s, FP32 67 TFLOPS, BF16/FP16 tensor 1979
# TFLOPS with sparsity -> 989.5 dense, INT8 1979 TOPS dense; PCIe Gen5 x16 128 GB/s
# bidirectional -> 64 GB/s per direction.
H100 = Level("H100-80GB", 80 * GiB, 3350 * GB, {"float32": 67 * TFLOPS, "float16": 989.5 * TFLOPS,
                                                "bfloat16": 989.5 * TFLOPS, "int8": 1979 * TFLOPS})
H100_LINK = Link(h2d=64 * GB, d2h=64 * GB)
# H100 SXM5 NVLink 4: 18 links, 900 GB/s bidirectional per GPU -> 450 GB/s per direction.
H100_NVLINK = 450 * GB
# T4 and L4 have no NVLink: their all-reduces cross PCIe (HardwareSpec.interconnect = 0).
# Every preset gives each GPU its own x16 link (`link_shared=False`), as the paper's multi-T4
# VMs do; a host whose GPUs sit behind one switch uplink is a profile JSON with "link_shared": true
# (or `moelight plan --shared-link`). Ring all-reduce step latency: HardwareSpec's 5 us default, an
# assumption of the order of NCCL's small-message latency, not a measurement.

# ---- CPU hosts ----
# S1 / S6-S9: GCP N1 VMs with T4s; 2.30 GHz is the N1 Haswell (Xeon E5-2699 v3 class) clock.
# "24-core, 192 GB" = 48 vCPUs (24 physical cores, 2 hyper-threads each).
# FP32 peak: 24 cores x 2.3 GHz x 32 FLOP/cycle (2 AVX2 FMA units x 8 lanes x 2) = 1.77 TFLOPS.
# No bf16 units: bf16 kernels convert to fp32, so bf16 = fp32 rate (an upper bound).
# Memory bandwidth: a 48-vCPU N1 VM spans both sockets of the host; each Haswell socket has
# 4 channels of DDR4-2133 = 68 GB/s, 136 GB/s per host; STREAM reaches ~75% of that, and the
# VM has most but not all of the cores, so we take 100 GB/s.
XEON_N1_24 = Level("Xeon-2.3GHz-24c", 192 * GiB, 100 * GB,
                   {"float32": 1.77 * TFLOPS, "bfloat16": 1.77 * TFLOPS, "float16": 1.77 * TFLOPS})
# S2: GCP G2 (L4) VMs run Cascade Lake at 2.20 GHz; g2-standard-48 = 48 vCPUs / 192 GB.
# FP32 peak: 24 cores x 2.2 GHz x 64 FLOP/cycle (2 AVX-512 FMA units x 16 lanes x 2) = 3.38 TFLOPS.
# Bandwidth: 6 channels DDR4-2933 = 140.8 GB/s per socket; the VM holds about one socket's worth
# of cores; at ~80% STREAM efficiency we take 110 GB/s.
XEON_G2_24 = Level("Xeon-2.2GHz-24c", 192 * GiB, 110 * GB,
                   {"float32": 3.38 * TFLOPS, "bfloat16": 3.38 * TFLOPS, "float16": 3.38 * TFLOPS})
# S6-S9: "32-core, 416 GB" = n1-highmem-64 (64 vCPUs, 416 GB), Haswell 2.3 GHz, both sockets:
# 32 x 2.3 GHz x 32 = 2.36 TFLOPS FP32; 2 sockets x 68 GB/s = 136 GB/s peak, ~75% -> 100 GB/s
# (the VM covers the whole host, so a little more than the 24-core VM: 110 GB/s).
XEON_N1_32 = Level("Xeon-2.3GHz-32c", 416 * GiB, 110 * GB,
                   {"float32": 2.36 * TFLOPS, "bfloat16": 2.36 * TFLOPS, "float16": 2.36 * TFLOPS})
# Generic host for the bare GPU presets: 2-socket server, 512 GB, 8-channel DDR4-3200 per
# socket (204.8 GB/s/socket -> ~300 GB/s usable), 64 cores x 2.5 GHz x 64 FLOP/cycle = 10 TFLOPS.
GENERIC_HOST = Level("server-64c", 512 * GiB, 300 * GB,
                     {"float32": 10 * TFLOPS, "bfloat16": 10 * TFLOPS, "float16": 10 * TFLOPS})

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
