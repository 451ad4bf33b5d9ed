"""Policy (what the engine runs with) and PlanResult (what the planner predicts)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hrm.dtypes import canonical_dtype


@dataclass(frozen=True)
class Policy:
    """The paper's 6-tuple (N, mu, A_g, F_g, r_w, r_c) plus the dtype it was planned for.

    batch_size N = micro_batch_size mu * num_micro_batches. r_w: share of every layer's
    expert weights resident on the GPU (the rest is paged in per layer); r_c: share of
    the KV cache resident on the GPU (only with attention on the GPU).
    """

    batch_size: int
    micro_batch_size: int
    num_micro_batches: int
    attn_on_gpu: bool
    ffn_on_gpu: bool
    r_w: float
    r_c: float
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if min(self.batch_size, self.micro_batch_size, self.num_micro_batches) < 1:
            raise ValueError("batch_size, micro_batch_size and num_micro_batches must be at least 1")
        if self.batch_size != self.micro_batch_size * self.num_micro_batches:
            raise ValueError("batch_size must equal micro_batch_size * num_micro_batches")
        if not (0.0 <= self.r_w <= 1.0 and 0.0 <= self.r_c <= 1.0):
            raise ValueError("r_w and r_c must lie in [0, 1]")

    # paper notation
    @property
    def N(self) -> int:  # noqa: N802
        return self.batch_size

    @property
    def mu(self) -> int:
        return self.micro_batch_size

    @property
    def n_mb(self) -> int:
        return self.num_micro_batches

    @property
    def A_g(self) -> int:  # noqa: N802
        return int(self.attn_on_gpu)

    @property
    def F_g(self) -> int:  # noqa: N802
        return int(self.ffn_on_gpu)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Policy:
        """A policy from its JSON fields; ValueError naming every field that is missing, unknown or of
        the wrong type (not just the first)."""
        if not isinstance(d, dict):
            raise ValueError(f"a policy is a JSON object of {', '.join(cls.__dataclass_fields__)}; got "
                             f"{type(d).__name__}")
        kinds = {"batch_size": int, "micro_batch_size": int, "num_micro_batches": int, "attn_on_gpu": bool,
                 "ffn_on_gpu": bool, "r_w": (int, float), "r_c": (int, float), "dtype": str}
        problems = [f"missing {k!r}" for k in kinds if k not in d and k != "dtype"]
        problems += [f"unknown field {k!r}" for k in d if k not in kinds]
        problems += [f"{k!r} must be {_kind_name(t)}, got {d[k]!r}" for k, t in kinds.items()
                     if k in d and (not isinstance(d[k], t) or (t is int and isinstance(d[k], bool)))]
        if isinstance(d.get("dtype"), str):
            try:
                canonical_dtype(d["dtype"])
            except ValueError as e:
                problems.append(f"'dtype': {e}")
        if problems:
            raise ValueError("; ".join(problems) + f" (fields: {', '.join(kinds)}; `moelight plan --save-policy` "
                             "writes one)")
        return cls(**d)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2))
        return p

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        return cls.from_dict(json.loads(Path(path).read_text()))


def _kind_name(t) -> str:
    names = {int: "an integer", bool: "true or false", str: "a string"}
    return "a number" if isinstance(t, tuple) else names[t]


# every part of the memory model a placement may hold, in the order the JSON lists them: to_dict gives each
# one (0 where the placement holds none), so a script reads them without checking which are there
GPU_MEMORY_PARTS = ("non_expert_weights", "resident_experts", "paged_weight_buffers", "dequantized_layer",
                    "activations", "prefill_attention_scratch", "kv_cache", "kv_prefetch_buffers")
CPU_MEMORY_PARTS = ("non_expert_weights", "activations", "experts", "kv_cache", "pinned_weight_pages",
                    "pinned_activations")


@dataclass
class PlanResult:
    """A policy with its HRM prediction and the reasons behind it (all times in seconds)."""

    policy: Policy
    hardware: str
    model: str
    workload: dict
    family: str
    prefill_tok_s: float
    decode_tok_s: float
    e2e_tok_s: float
    prefill_time: float
    decode_step_time: float
    layer_times: dict[str, float]
    binding: str  # "link", "host", "stage", "gpu" or "cpu": the largest term of T_layer
    gpu_memory: dict[str, float] = field(default_factory=dict)  # bytes per component
    cpu_memory: dict[str, float] = field(default_factory=dict)
    gpu_capacity: float = 0.0  # usable bytes (alpha x capacity)
    cpu_capacity: float = 0.0
    reason: str = ""
    # the best predicted end-to-end tok/s of every placement searched (None: nothing fits there)
    placements: dict[str, float | None] = field(default_factory=dict)
    # the full memory levels ('GPU', 'CPU') more of which would predict faster (None: not checked)
    memory_limits: list[str] | None = None
    mu_cap: int = 0  # the largest micro-batch the search's grid holds (0: no search)
    solve_seconds: float = 0.0
    grid_points: int = 0

    def memory_problems(self) -> list[str]:
        """What does not fit in this plan's memory model, by level and by how much (empty: it fits)."""
        out = []
        for level, parts, cap in (("GPU", self.gpu_memory, self.gpu_capacity), ("CPU", self.cpu_memory,
                                                                                 self.cpu_capacity)):
            need = sum(parts.values())
            if parts and need > cap * (1 + 1e-6):
                top = ", ".join(f"{k} {size_text(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:4])
                out.append(f"{level} memory: needs {size_text(need)} of {size_text(cap)} usable, short by "
                           f"{size_text(need - cap)} ({top})")
        return out

    def to_dict(self) -> dict:
        """The plan as JSON: the memory maps hold every part (0.0 where unused), the same keys for any placement."""
        d = asdict(self)
        d["policy"] = self.policy.to_dict()
        d["gpu_memory"] = {k: 0.0 for k in GPU_MEMORY_PARTS} | self.gpu_memory
        d["cpu_memory"] = {k: 0.0 for k in CPU_MEMORY_PARTS} | self.cpu_memory
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def size_text(n: float) -> str:
    """Bytes in GiB, or MiB below a tenth of one (a tiny device's shortfall is no '0.00 GiB')."""
    gib = 2.0**30
    return f"{n / gib:.2f} GiB" if n >= gib / 10 else f"{n / 2**20:.2f} MiB"


def time_text(seconds: float) -> str:
    """A per-layer time in ms, or in us below a tenth of a ms (a tiny model's 0.0135 ms is no '0.00 ms')."""
    ms = seconds * 1e3
    if ms == 0:
        return "0 ms"
    if ms >= 0.1:
        return f"{ms:.2f} ms"
    return f"{ms * 1e3:.2f} us" if ms * 1e3 >= 0.01 else f"{ms * 1e3:.2g} us"


def share_text(r: float) -> str:
    """r_w / r_c as every line prints them."""
    return f"{r:.4f}"


class InfeasibleError(ValueError):
    """No policy fits in memory; the message says which memory and by how much."""
