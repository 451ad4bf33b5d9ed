"""Hardware specs for the Hierarchical Roofline Model: levels (GPU, CPU) and the link.

A level has a memory capacity, a memory bandwidth and a peak FLOP/s per dtype.
A measured level (`moelight profile`) may also carry what the engine's own kernels
achieve there: GEMM FLOP/s as a function of the row count M (small-M matmuls run far
below peak on a CPU), the attention kernels' bandwidth / FLOP/s, and the fixed
per-layer and per-step costs of dispatching work (Python, kernel launches), and the rate
of its element-wise ops. Presets leave them empty and fall back to the datasheet roofs.
GPU numbers are per GPU; `HardwareSpec.gpu_total()` gives the t-GPU aggregate the
planner uses for tensor parallelism (t x memory, bandwidth and compute), `link_total()` the
aggregate CPU->GPU link (t x one link when each GPU has its own lanes, one link when a
preset says they share it), and `interconnect` the GPU<->GPU bandwidth the layers'
all-reduces run at (NVLink where a preset has it, else PCIe: the GPUs' own host links).
The JSON form is the profile cache written by `moelight profile`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from hrm.dtypes import canonical_dtype
from hrm.hardware_checks import missing_fields, spec_problems

GiB = 1024**3
GB = 1e9
TFLOPS = 1e12


def _interp_curve(curve: list[list[float]], rows):
    """A measured [[M, FLOP/s], ...] curve at `rows`: interpolated in log M, clamped at its ends."""
    ms = np.log([max(1.0, c[0]) for c in curve])
    fs = np.array([c[1] for c in curve], float)
    return np.interp(np.log(np.maximum(1.0, np.asarray(rows, float))), ms, fs)


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: a processor with its own memory."""

    name: str
    memory_bytes: float
    bandwidth: float  # bytes/s the processor reads its own memory at
    flops: dict[str, float] = field(default_factory=dict)  # dtype -> peak FLOP/s
    # dtype -> [[M, FLOP/s], ...] measured for the engine's GEMM kernel, M ascending
    gemm_flops: dict[str, list[list[float]]] = field(default_factory=dict)
    # the form the engine held bf16 matmul weights in when that curve was measured (a CPU level:
    # runtime/cpu_linear's linear_form, 'packed' | 'strips' | 'float32' | 'dense'); '' where not recorded
    gemm_form: str = ""
    attention_bandwidth: float = 0.0  # bytes/s the decode attention kernel reads KV at (0: bandwidth)
    attention_flops: dict[str, float] = field(default_factory=dict)  # prefill attention kernel FLOP/s
    layer_overhead_s: float = 0.0  # fixed cost of one layer pass of one micro-batch
    # a GPU's fixed cost of one layer pass through the CGOPipe runtime (its tasks, lanes and the CPU
    # attention's round trip), measured through the runtime; 0: not measured, layer_overhead_s alone
    runtime_layer_s: float = 0.0
    step_overhead_s: float = 0.0  # fixed cost per micro-batch per step outside the layers
    # the host's seconds per sequence per decode step outside the layers (scheduling, block tables,
    # sampling, results): the CPU level's, paid whatever runs the layers
    sequence_step_s: float = 0.0
    elementwise_bandwidth: float = 0.0  # bytes/s of the engine's element-wise ops (0: fused, free)
    # bytes/s a memory-bound GEMM (decode: few rows per weight) streams its weights at; small-M kernels
    # reach far less than a copy does (0: the level's bandwidth)
    gemm_bandwidth: float = 0.0
    # dtype or quantized expert format ('int8', 'uint4') -> [[rows per expert, FLOP/s], ...] of the engine's
    # routed-expert kernel where it is not the GEMM above (the fused CPU kernel: on hosts where oneDNN does
    # not pack bf16 it runs ~5x aten's rate; int4 experts multiply on int8 activations, faster again)
    expert_gemm_flops: dict[str, list[list[float]]] = field(default_factory=dict)
    # bytes/s of the host's passes over a decode step's float32 logits (widen, finiteness check, greedy
    # argmax: hrm.costs.LOGIT_PASS_BYTES a logit); 0: not measured, free
    logits_bandwidth: float = 0.0
    # bytes/s a fresh KV cache pool is faulted in at by the engine's first writes into its pages (the kernel
    # maps and zeroes every page the job's KV lands on, once); 0: not measured, free
    kv_first_touch_bandwidth: float = 0.0
    # a GPU that multiplies quantized experts as they are (moelight's fused dequant-GEMM, Triton): no
    # dequantize pass per layer, no dense layer buffer; False: it expands a layer's experts first
    fused_dequant: bool = False

    def gemm_peak(self, dtype: str, rows=None):
        """FLOP/s of a GEMM with `rows` rows (M): the measured curve interpolated in log M,
        clamped at its ends; the plain peak without a curve or without `rows`."""
        curve = self.gemm_flops.get(canonical_dtype(dtype)) if rows is not None else None
        return _interp_curve(curve, rows) if curve else self.peak_flops(dtype)

    def expert_peak(self, dtype: str, rows=None, fmt: str = ""):
        """FLOP/s of the routed experts at `rows` tokens per expert: the expert kernel's curve for the
        experts' quantized format `fmt` where one was measured, else for the dtype, else the GEMM's."""
        curves = self.expert_gemm_flops
        curve = (curves.get(fmt) or curves.get(canonical_dtype(dtype))) if rows is not None else None
        return _interp_curve(curve, rows) if curve else self.gemm_peak(dtype, rows)

    def attention_peak(self, dtype: str) -> float:
        return self.attention_flops.get(canonical_dtype(dtype)) or self.peak_flops(dtype)

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`; falls back to float32 (kernels that upcast run at that rate)."""
        key = canonical_dtype(dtype)
        if key in self.flops:
            return self.flops[key]
        if "float32" in self.flops:
            return self.flops["float32"]
        raise KeyError(f"level {self.name!r} has no FLOP/s for {dtype!r} nor float32")

    def scaled(self, t: int) -> Level:
        """t identical devices seen as one (tensor parallel): every quantity times t."""
        return replace(
            self,
            name=f"{t}x{self.name}" if t != 1 else self.name,
            memory_bytes=self.memory_bytes * t,
            bandwidth=self.bandwidth * t,
            flops={k: v * t for k, v in self.flops.items()},
            gemm_flops={k: [[m, f * t] for m, f in c] for k, c in self.gemm_flops.items()},
            expert_gemm_flops={k: [[m, f * t] for m, f in c] for k, c in self.expert_gemm_flops.items()},
            attention_bandwidth=self.attention_bandwidth * t,
            attention_flops={k: v * t for k, v in self.attention_flops.items()},
            elementwise_bandwidth=self.elementwise_bandwidth * t,
            gemm_bandwidth=self.gemm_bandwidth * t,
            logits_bandwidth=self.logits_bandwidth * t,
            kv_first_touch_bandwidth=self.kv_first_touch_bandwidth * t,
        )

    def weight_stream_bandwidth(self) -> float:
        """Bytes/s a GEMM with few rows reads its weights at (decode)."""
        return self.gemm_bandwidth or self.bandwidth


@dataclass(frozen=True)
class Link:
    """CPU<->GPU link of one GPU, one number per direction (they run concurrently), as achieved:
    pinned DMA rates, the (slower) rates from pageable memory, which the driver stages through its
    own pinned buffer, and the fixed cost of one copy (issue, DMA setup, completion)."""

    h2d: float  # bytes/s, CPU (pinned) -> GPU
    d2h: float  # bytes/s, GPU -> CPU (pinned)
    pageable_h2d: float = 0.0  # bytes/s from pageable host memory (0: half the pinned rate)
    pageable_d2h: float = 0.0
    latency_s: float = 0.0  # seconds per copy, whatever its size

    def rate(self, direction: str, pinned: bool = True) -> float:
        """Bytes/s of one direction, from pinned or pageable host memory."""
        if direction not in ("h2d", "d2h"):
            raise ValueError("direction must be 'h2d' or 'd2h'")
        pinned_rate = self.h2d if direction == "h2d" else self.d2h
        if pinned:
            return pinned_rate
        return (self.pageable_h2d if direction == "h2d" else self.pageable_d2h) or pinned_rate / 2

    def copy_seconds(self, nbytes, direction: str = "h2d", copies=1, pinned: bool = True):
        """Time of `copies` copies moving `nbytes` in all: the fixed cost per copy plus bytes / rate."""
        return np.asarray(copies, float) * self.latency_s + np.asarray(nbytes, float) / self.rate(direction, pinned)


@dataclass(frozen=True)
class HardwareSpec:
    """A host: a CPU level, optionally `gpu_count` identical GPUs with their links to the host."""

    name: str
    cpu: Level
    gpu: Level | None = None
    gpu_count: int = 0
    link: Link | None = None
    notes: str = ""
    link_shared: bool = False  # the GPUs reach the host through one link (a switch's uplink), not one each
    interconnect: float = 0.0  # GPU<->GPU bytes/s per direction per GPU (NVLink); 0: over the PCIe links
    interconnect_latency_s: float = 5e-6  # per step of a ring all-reduce (2(t-1) steps)
    host_bandwidth: float = 0.0  # bytes/s host memory serves staging copies, DMA and attention together (0: cpu's)
    # bytes/s the runtime copies pageable weights into its pinned staging buffers at, with the threads it
    # gives that copy (0: half the host memory bandwidth, a copy reads and writes every byte)
    staging_bandwidth: float = 0.0
    # when `moelight profile` measured it (ISO 8601, UTC; "" for presets): a host whose speed drifts makes an
    # old profile's predictions miss, so a job's report says how old the profile behind its prediction is
    measured_at: str = ""

    def __post_init__(self) -> None:
        if self.gpu is None and self.gpu_count:
            raise ValueError("gpu_count > 0 but no GPU level given")
        if self.gpu is not None and self.gpu_count > 0 and self.link is None:
            raise ValueError("a GPU needs a CPU<->GPU link")

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.gpu_count > 0

    def with_gpus(self, t: int) -> HardwareSpec:
        """Same host with t GPUs of the same kind (t=0: CPU only)."""
        if t < 0:
            raise ValueError("gpu count must be >= 0")
        if t > 0 and self.gpu is None:
            raise ValueError(f"hardware {self.name!r} has no GPU to replicate")
        return replace(self, gpu_count=t)

    def preferred_dtype(self) -> str:
        """The 16-bit dtype this host computes fastest in: the GPU's faster of bfloat16 and
        float16 (float16 on a T4, which has no bf16 tensor cores), bfloat16 on a CPU-only host
        (half the bytes of float32; CPUs without bf16 units convert at the float32 rate)."""
        if not self.has_gpu:
            return "bfloat16"
        f = self.gpu.flops  # per GPU; the same for any count
        return "float16" if f.get("float16", 0.0) > f.get("bfloat16", 0.0) else "bfloat16"

    def gpu_total(self) -> Level | None:
        """All GPUs as one level (tensor parallelism), or None on a CPU-only host."""
        if not self.has_gpu:
            return None
        return self.gpu.scaled(self.gpu_count)

    def link_total(self) -> Link | None:
        """Aggregate CPU<->GPU link: each GPU's own PCIe lanes add up; a shared link does not."""
        if not self.has_gpu:
            return None
        t = 1 if self.link_shared else self.gpu_count
        lk = self.link
        return replace(lk, h2d=lk.h2d * t, d2h=lk.d2h * t, pageable_h2d=lk.pageable_h2d * t,
                       pageable_d2h=lk.pageable_d2h * t)

    def staging_rate(self) -> float:
        """Bytes/s of the first paging hop (CPU memory -> pinned buffer)."""
        return self.staging_bandwidth or self.host_memory_bandwidth() / 2

    def host_memory_bandwidth(self) -> float:
        """What the host's memory delivers to everything that moves through it at once: the staging
        copies, every link's DMA and the CPU attention (the HRM's host roof)."""
        return self.host_bandwidth or self.cpu.bandwidth

    @property
    def interconnect_over_pcie(self) -> bool:
        """All-reduces between the GPUs cross their host links (no NVLink), competing with paging."""
        return self.interconnect <= 0

    def interconnect_bandwidth(self) -> float:
        """Bytes/s per direction one GPU exchanges with its ring neighbours: NVLink, or its PCIe
        link (a shared link split between the GPUs)."""
        if not self.has_gpu:
            return 0.0
        if self.interconnect > 0:
            return self.interconnect
        return min(self.link.h2d, self.link.d2h) / (self.gpu_count if self.link_shared else 1)

    # ---- JSON (profile cache) ----
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HardwareSpec:
        if not isinstance(d, dict):
            raise ValueError(f"malformed hardware spec: a JSON object of cpu, gpu, link ... is needed, got "
                             f"{type(d).__name__}")
        unknown = [k for k in d if k not in _field_names(cls)]
        for part, kind in (("cpu", Level), ("gpu", Level), ("link", Link)):
            if isinstance(d.get(part), dict):
                unknown += [f"{part}.{k}" for k in d[part] if k not in _field_names(kind)]
        if unknown:  # a misspelt field would fall back to its default without a word
            raise ValueError(f"malformed hardware spec: unknown field(s) {', '.join(unknown)}; the fields are "
                             f"{', '.join(_field_names(cls))} (cpu / gpu: {', '.join(_field_names(Level))}; "
                             f"link: {', '.join(_field_names(Link))})")
        missing = missing_fields(d)
        if missing:
            raise ValueError(f"malformed hardware spec: missing {', '.join(missing)}")
        try:
            gpu = Level(**d["gpu"]) if d.get("gpu") else None
            link = Link(**d["link"]) if d.get("link") else None
            return cls(
                name=d.get("name", "profiled"),
                cpu=Level(**d["cpu"]),
                gpu=gpu,
                gpu_count=d.get("gpu_count", 1 if gpu else 0),
                link=link,
                notes=d.get("notes", ""),
                # taken as written, checked below: bool("false") and int(2.7) would silently misread them
                link_shared=d.get("link_shared", False),
                interconnect=d.get("interconnect", 0.0),
                interconnect_latency_s=d.get("interconnect_latency_s", 5e-6),
                host_bandwidth=d.get("host_bandwidth", 0.0),
                staging_bandwidth=d.get("staging_bandwidth", 0.0),
                measured_at=d.get("measured_at", ""),
            )._checked()
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed hardware spec: {e}") from e

    def _checked(self) -> HardwareSpec:
        """Itself, if every rate and size is a number the model can divide by (ValueError naming each
        field that is not: a zero bandwidth, a negative memory, "lots", a dtype key it never looks up)."""
        bad = spec_problems(self)
        if bad:
            raise ValueError(f"hardware spec {self.name!r}: " + "; ".join(bad))
        return self

    def save(self, path: str | Path) -> Path:
        """Atomically (a file of this process's, then a rename): two jobs profiling at once, or one killed
        mid-write, never leave a reader half a profile."""
        p = Path(path).expanduser()
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(self.to_dict(), indent=2))
            os.replace(tmp, p)
        finally:
            tmp.unlink(missing_ok=True)
        return p

    @classmethod
    def load(cls, path: str | Path) -> HardwareSpec:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"hardware profile not found: {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"hardware profile {p} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(d)
        except ValueError as e:  # name the file: a plan may read several
            raise ValueError(f"{p}: {e}") from None


def _field_names(cls) -> list[str]:
    return [f.name for f in fields(cls)]
