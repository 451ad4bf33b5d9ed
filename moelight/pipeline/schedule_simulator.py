"""Times a schedule's task graph with HRM costs, for any hardware spec (no GPU needed).

List scheduling with the executor's semantics (see schedule.py): each lane is serial
and, whenever it is free, starts the earliest-launched task whose dependencies are done.
Costs come from `hrm.costs` (roofline time of each kernel on its level, bytes / link
bandwidth for transfers), so the simulator answers "what would this schedule do on a
T4" and the planner's per-layer estimate can be checked against an actual timeline.

With t GPUs (tensor parallelism) every GPU task is one rank's share at t x the FLOP/s and
bandwidth, and a post-attention task also waits for its two all-reduces. Two resources the
lanes do not model are applied as roofs on the whole pass (`pass_roofs`): over PCIe the
all-reduces' ring traffic shares the host links with the transfers, and host memory serves
the staging copies, every link's DMA and the CPU attention at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hrm import costs
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec
from moelight.pipeline.schedule import LANES, GraphShape, Schedule, build_decode, build_prefill


@dataclass
class Timeline:
    """Start and end of every task of a schedule, in seconds from the pass's start."""

    schedule: Schedule
    start: list[float]
    end: list[float]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def busy(self, lane: str) -> float:
        return sum(self.end[t.index] - self.start[t.index] for t in self.schedule.tasks if t.lane == lane)

    def utilisation(self) -> dict[str, float]:
        span = self.makespan or 1.0
        return {lane: self.busy(lane) / span for lane in LANES if self.schedule.by_lane(lane)}

    def check(self, eps: float = 1e-12) -> None:
        """Raise AssertionError unless every dependency and every lane's seriality holds."""
        for t in self.schedule.tasks:
            assert self.end[t.index] >= self.start[t.index] - eps, t.name
            for d in t.deps:
                assert self.start[t.index] >= self.end[d] - eps, (
                    f"{t.name} starts before {self.schedule.tasks[d].name}"
                )
        for lane in LANES:
            iv = sorted((self.start[t.index], self.end[t.index], t.name) for t in self.schedule.by_lane(lane))
            for (_, e0, n0), (s1, _, n1) in zip(iv, iv[1:], strict=False):
                assert s1 >= e0 - eps, f"lane {lane}: {n1} overlaps {n0}"


def list_schedule(schedule: Schedule, durations: list[float]) -> Timeline:
    """Event-driven list scheduling: lanes serial, ready-first, launch order as priority."""
    tasks = schedule.tasks
    n = len(tasks)
    waiting = [len(t.deps) for t in tasks]
    users: list[list[int]] = [[] for _ in range(n)]
    for t in tasks:
        for d in t.deps:
            users[d].append(t.index)
    ready_at = [0.0] * n
    known: dict[str, list[tuple[float, int]]] = {lane: [] for lane in LANES}  # deps done: (ready, index)
    for t in tasks:
        if not t.deps:
            known[t.lane].append((0.0, t.index))
    free = dict.fromkeys(LANES, 0.0)
    start, end = [0.0] * n, [0.0] * n
    for _ in range(n):
        best = None  # (decision time, index, lane)
        for lane, cand in known.items():
            if not cand:
                continue
            t_dec = max(free[lane], min(r for r, _ in cand))
            idx = min(i for r, i in cand if r <= t_dec)
            if best is None or (t_dec, idx) < best[:2]:
                best = (t_dec, idx, lane)
        if best is None:
            raise ValueError("schedule has a dependency cycle")
        t_dec, idx, lane = best
        known[lane].remove((ready_at[idx], idx))
        start[idx], end[idx] = t_dec, t_dec + durations[idx]
        free[lane] = end[idx]
        for u in users[idx]:
            ready_at[u] = max(ready_at[u], end[idx])
            waiting[u] -= 1
            if waiting[u] == 0:
                known[tasks[u].lane].append((ready_at[u], u))
    return Timeline(schedule, start, end)


def task_durations(
    schedule: Schedule,
    hw: HardwareSpec,
    m: ModelSpec,
    dtype: str = "bfloat16",
    pin_bandwidth: float | None = None,
) -> list[float]:
    """HRM seconds of every task. Staging into pinned memory is a host memcpy at the runtime's
    staging rate (HardwareSpec.staging_rate); every copy pays the link's fixed cost; a GPU
    post-attention task carries the layer pass's dispatch overhead."""
    gpu = costs.level_of(hw, "gpu")
    b = dtype_bytes(dtype)
    pin_bw = pin_bandwidth or hw.staging_rate()

    def one(t) -> float:
        op, mu = t.op, max(t.tokens, 0)
        if op == "embed":
            return float(costs.hidden_bytes(m, mu, dtype)) / gpu.bandwidth
        if op == "pre_attn":
            return costs.pre_attention_time(hw, m, mu, "gpu", dtype)
        if op == "post_attn":  # with t GPUs: the O-projection and FFN all-reduces hold the stream
            return (costs.post_attention_time(hw, m, mu, "gpu", dtype) + costs.layer_allreduce_time(hw, m, mu, dtype)
                    + costs.runtime_layer_time(hw, 1.0, "gpu"))
        if op == "cpu_attn":
            return costs.attention_time(hw, m, mu, t.context, "cpu", dtype)
        if op == "gpu_attn":
            return costs.attention_time(hw, m, mu, t.context, "gpu", dtype)
        if op == "prefill_attn":
            seqs = schedule.shape.mb_tokens[0]
            return float(costs.op_time(ops.prefill_attention(m, seqs, t.context, b), gpu, dtype,
                                       peak=gpu.attention_peak(dtype)))
        if op == "lm_head":
            return costs.lm_head_time(hw, m, mu, "gpu", dtype)
        if op == "logits_d2h":  # from the GPU that ran the head (rank 0), over its own link
            return costs.logits_to_host_time(hw, m, t.nbytes / schedule.shape.logits_bytes_per_token)
        if op in ("qkv_d2h", "kv_d2h"):
            return costs.transfer_time(hw, t.nbytes, "d2h")
        if op in ("attn_h2d", "w_h2d", "kv_h2d"):
            return costs.transfer_time(hw, t.nbytes, "h2d")
        if op == "w_stage":
            return t.nbytes / pin_bw
        if op == "kv_write":
            return mu * ops.kv_bytes_per_token_layer(m, b) / hw.cpu.bandwidth
        raise ValueError(f"no cost for op {op!r}")

    return [float(one(t)) for t in schedule.tasks]


def pass_roofs(schedule: Schedule, hw: HardwareSpec, m: ModelSpec, dtype: str = "bfloat16") -> dict[str, float]:
    """Lower bounds on a pass from shared resources: each link direction with the all-reduces'
    PCIe traffic added, and host memory (staged pages are read and written by the copy and read
    by the DMA; the CPU attention reads the KV cache; KV and activations cross it once)."""
    b = dtype_bytes(dtype)
    h2d = d2h = host = 0.0
    for t in schedule.tasks:
        if t.lane == "h2d":
            h2d += t.nbytes
        elif t.lane == "d2h":
            d2h += t.nbytes
        if t.op == "post_attn":
            ring = float(costs.allreduce_link_bytes(hw, m, max(t.tokens, 0), dtype))
            h2d, d2h = h2d + ring, d2h + ring
        if t.op == "w_stage":  # its h2d (the DMA's read) is one of the passes
            host += costs.STAGING_PASSES * t.nbytes
        elif t.op == "cpu_attn":
            host += float(ops.decode_attention(m, t.tokens, t.context, b).bytes)
        elif t.op == "kv_write":
            host += t.tokens * ops.kv_bytes_per_token_layer(m, b)
        elif t.lane in ("h2d", "d2h") and t.op != "w_h2d":  # KV and activations cross host memory once
            host += t.nbytes
    link = hw.link_total()
    return {"link": max(h2d / link.h2d, d2h / link.d2h), "host": host / hw.host_memory_bandwidth()}


def simulate(schedule: Schedule, hw: HardwareSpec, m: ModelSpec, dtype: str = "bfloat16") -> Timeline:
    return list_schedule(schedule, task_durations(schedule, hw, m, dtype))


def pass_seconds(timeline: Timeline, hw: HardwareSpec, m: ModelSpec, dtype: str) -> tuple[float, str]:
    """(seconds, what binds): the timeline's makespan, unless a shared-resource roof is longer."""
    roofs = {"schedule": timeline.makespan, **pass_roofs(timeline.schedule, hw, m, dtype)}
    bound = max(roofs, key=roofs.get)
    return roofs[bound], bound


def shape_from_spec(
    m: ModelSpec,
    mu: int,
    n_mb: int,
    context: float,
    r_w: float,
    dtype: str = "bfloat16",
    prompt_tokens: int = 0,
) -> GraphShape:
    """Graph shape of a Policy on an HRM model (steady state: weights prefetched across passes)."""
    return GraphShape(
        n_layers=m.num_layers,
        mb_tokens=(int(mu),) * int(n_mb),
        mb_context=(float(context),) * int(n_mb),
        qkv_bytes_per_token=float(costs.qkv_bytes(m, 1, dtype)),
        attn_bytes_per_token=float(costs.attention_output_bytes(m, 1, dtype)),
        kv_bytes_per_token_layer=float(costs.kv_cache_bytes(m, 1, 1, dtype)),
        logits_bytes_per_token=costs.LOGITS_BYTES * m.vocab_size,
        paged_bytes_per_layer=(1.0 - float(r_w)) * costs.layer_expert_bytes(m, dtype),
        prompt_tokens=int(prompt_tokens),
    )


@dataclass
class SimResult:
    """Simulated decode step and prefill of one batch under a policy and a schedule."""

    schedule: str
    hardware: str
    model: str
    policy: object
    step: Timeline
    prefill: Timeline
    prefill_seconds: float  # all micro-batches of the batch
    step_seconds: float
    layer_seconds: float
    decode_tok_s: float
    e2e_tok_s: float
    utilisation: dict[str, float] = field(default_factory=dict)
    bound: str = "schedule"  # what sets the decode step: the timeline, or the link / host-memory roof

    def summary(self) -> str:
        u = "  ".join(f"{k} {v:5.1%}" for k, v in self.utilisation.items())
        return (
            f"{self.schedule:16s} layer {self.layer_seconds * 1e3:8.2f} ms  step {self.step_seconds:7.3f} s  "
            f"decode {self.decode_tok_s:9.1f} tok/s  e2e {self.e2e_tok_s:9.1f} tok/s  bound {self.bound} | {u}"
        )


def simulate_policy(
    hw: HardwareSpec, m: ModelSpec, workload: WorkloadSpec, policy, schedule: str
) -> SimResult:
    """Batch = policy.batch_size sequences of the workload: prefill each micro-batch on the
    GPU, then gen_len - 1 decode steps at the mean context (DESIGN.md section 9 formula)."""
    mu, n, dtype = policy.micro_batch_size, policy.num_micro_batches, policy.dtype
    prompt = workload.effective_prompt
    step = simulate(
        build_decode(schedule, shape_from_spec(m, mu, n, workload.mean_context, policy.r_w, dtype)),
        hw,
        m,
        dtype,
    )
    # prefill: one layer-major pass over the batch (weights streamed once), or the runtime's chunks of
    # at most workload.prefill_chunk tokens, each a pass through all layers
    loads = float(workload.prefill_weight_loads(mu, n))
    seqs = max(1, int(round(mu * n / loads)))
    pre_shape = shape_from_spec(m, seqs, 1, prompt, policy.r_w, dtype, prompt_tokens=int(round(seqs * prompt)))
    pre = simulate(build_prefill(pre_shape), hw, m, dtype)
    t_pre = mu * n / seqs * pass_seconds(pre, hw, m, dtype)[0]
    t_step, bound = pass_seconds(step, hw, m, dtype)
    g = workload.gen_len
    return SimResult(
        schedule,
        hw.name + (f" ({hw.gpu_count}x {hw.gpu.name}{', shared link' if hw.link_shared else ''})"
                   if hw.gpu_count > 1 else ""),
        m.name,
        policy,
        step,
        pre,
        t_pre,
        t_step,
        t_step / m.num_layers,
        policy.batch_size / t_step,
        policy.batch_size * g / (t_pre + (g - 1) * t_step),
        step.utilisation(),
        bound,
    )
