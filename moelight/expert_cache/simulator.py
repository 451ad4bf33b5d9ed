"""Replaying a routing trace against a cache policy, with HRM costs for compute and the link.

The cache decisions are `cache_state.ExpertCache`'s, the very object the runtime drives, so a
policy's hits here equal its hits in the runtime on the same routing. Timing: B sequences decode
together (a finished one is replaced by the next request at once; new ones are prefilled
together). Per MoE layer pass on the GPU: pre-attention, attention and the router for the pass's
tokens, then the needed experts, each max(FLOPs / P, weight bytes / B) for its tokens. The
link is one copy queue (`LinkQueue`): a copy takes expert bytes / link bandwidth; demand
fetches go before every waiting prefetch; a copy under way is not interrupted. The experts start
once every needed one has arrived. Per-token latency is the decode step's duration.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hrm import costs
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from moelight.expert_cache.cache_state import CacheStats, ExpertCache, Fetch
from moelight.expert_cache.policies import CachePolicy
from moelight.expert_cache.trace import Trace, TraceError


class LinkQueue:
    """A serial copy engine with a priority queue (demand before prefetch, then priority, then order)."""

    def __init__(self, seconds_per_copy: float, bytes_per_copy: float, stats: CacheStats) -> None:
        self.dt, self.nbytes, self.stats = seconds_per_copy, bytes_per_copy, stats
        self.heap: list[tuple] = []
        self.busy_until = 0.0
        self.done_at: dict[int, float] = {}  # key -> when its latest copy completed
        self.waiting: dict[int, tuple] = {}  # key -> its heap entry, not started

    def push(self, f: Fetch, t: float) -> None:
        entry = (0 if f.demand else 1, -f.priority, f.order, f.key, t)
        self.waiting[f.key] = entry
        self.done_at.pop(f.key, None)
        heapq.heappush(self.heap, entry)

    def cancel(self, key: int) -> bool:
        """Drop a copy that has not started (its expert was evicted before it arrived)."""
        return self.waiting.pop(key, None) is not None

    def _start_next(self) -> None:
        entry = heapq.heappop(self.heap)
        key, issued = entry[3], entry[4]
        if self.waiting.get(key) is not entry:
            return  # cancelled, or superseded by a later fetch of the same key
        del self.waiting[key]
        self.busy_until = max(self.busy_until, issued) + self.dt
        self.done_at[key] = self.busy_until
        self.stats.fetched_bytes += self.nbytes

    def run_until(self, t: float) -> None:
        """Start every copy the engine would start before time t."""
        while self.heap and max(self.busy_until, self.heap[0][4]) < t:
            self._start_next()

    def late(self, key: int, t: float) -> bool:
        """Whether `key`'s copy is still waiting or under way at time t."""
        return key in self.waiting or self.done_at.get(key, 0.0) > t

    def ready_at(self, key: int) -> float:
        """When `key` is on the device (running the queue in order until it is)."""
        while key in self.waiting:
            self._start_next()
        return self.done_at.get(key, 0.0)


@dataclass
class CacheSimResult:
    policy: str
    slots: int
    batch: int
    stats: CacheStats
    token_latency: list[float] = field(default_factory=list)  # seconds per decode step
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens: int = 0

    def percentiles(self) -> dict[str, float]:
        lat = np.asarray(self.token_latency or [0.0]) * 1e3
        return {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 99)}

    def to_dict(self) -> dict:
        return {"policy": self.policy, "slots": self.slots, "batch": self.batch, **self.stats.to_dict(),
                "tpot_ms": self.percentiles(), "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "tokens": self.tokens}


class PassTimer:
    """HRM seconds of a layer pass's parts on one GPU (latency mode runs on one device)."""

    def __init__(self, hw: HardwareSpec, m: ModelSpec, dtype: str) -> None:
        if not hw.has_gpu:
            raise ValueError(f"hardware {hw.name!r} has no GPU: an expert cache lives on a GPU")
        self.gpu, self.m, self.b, self.dtype = hw.gpu, m, dtype_bytes(dtype), dtype
        self.copy = ops.expert_ffn(m, 0, self.b).bytes / hw.link.h2d

    def _t(self, c: ops.OpCost) -> float:
        return float(costs.op_time(c, self.gpu, self.dtype))

    def attention_part(self, tokens: int, seqs: int, context: float, prefill: bool) -> float:
        att = (ops.prefill_attention(self.m, seqs, tokens / max(1, seqs), self.b) if prefill
               else ops.decode_attention(self.m, seqs, context, self.b))
        m, b = self.m, self.b
        return (self._t(ops.qkv_proj(m, tokens, b)) + self._t(att) + self._t(ops.o_proj(m, tokens, b))
                + self._t(ops.router(m, tokens, b)))

    def experts(self, tokens_per_expert: np.ndarray) -> float:
        return sum(self._t(ops.expert_ffn(self.m, int(n), self.b)) for n in tokens_per_expert if n > 0)

    def head(self, tokens: int) -> float:
        return self._t(ops.lm_head(self.m, tokens, self.b))


def simulate_cache(trace: Trace, make_policy: Callable[[], CachePolicy], slots: int, hw: HardwareSpec,
                   model: ModelSpec, batch: int = 1, prefetch_per_layer: int | None = None,
                   dtype: str = "float16") -> CacheSimResult:
    """Replay `trace` with B = `batch` sequences at a time on `model`'s costs (its routing is the
    trace's, layer for layer: the trace must have the model's MoE layer and expert counts)."""
    tm = trace.model
    L = len(tm.moe_layers)
    if (L, tm.num_experts) != (model.num_layers - model.num_dense_layers, model.num_experts):
        raise TraceError(f"the trace routes {L} MoE layers x {tm.num_experts} experts, {model.name} has "
                         f"{model.num_layers - model.num_dense_layers} x {model.num_experts}")
    timer = PassTimer(hw, model, dtype)
    policy = make_policy()
    budget = default_prefetch_budget(hw, model, batch, dtype) if prefetch_per_layer is None else prefetch_per_layer
    cache = ExpertCache(L, tm.num_experts, slots, policy, budget if policy.predicts else 0)
    link = LinkQueue(timer.copy, ops.expert_ffn(model, 0, timer.b).bytes, cache.stats)
    res = CacheSimResult(policy.name, slots, batch, cache.stats)
    pending = list(range(len(trace.requests)))[::-1]
    active: dict[int, int] = {}  # request -> its next position
    refill_at = max(1, batch // 8)  # the engine admits waiting requests once this many slots are free
    now = 0.0

    def finish_done() -> None:  # the engine releases a sequence once its last token is sampled
        for r in [r for r, p in active.items() if p >= trace.requests[r].tokens]:
            del active[r]
            cache.release(r)

    while pending or active:
        if pending and (not active or batch - len(active) >= refill_at):
            new = [pending.pop() for _ in range(min(len(pending), batch - len(active)))]
            for r in new:
                policy.begin(r)
            t0 = now
            now = _pass(trace, new, {r: range(trace.requests[r].prompt_len) for r in new}, cache, link, timer, now,
                        prefill=True)
            res.prefill_seconds += now - t0
            active.update({r: trace.requests[r].prompt_len for r in new})
            finish_done()
        if not active:
            continue
        step = {r: range(p, p + 1) for r, p in active.items()}
        t0 = now
        now = _pass(trace, list(step), step, cache, link, timer, now, prefill=False)
        res.token_latency.append(now - t0)
        res.decode_seconds += now - t0
        res.tokens += len(step)
        for r in step:
            active[r] += 1
        finish_done()
    return res


def _pass(trace: Trace, reqs: list[int], rows: dict[int, range], cache: ExpertCache, link: LinkQueue,
          timer: PassTimer, now: float, prefill: bool) -> float:
    """One forward pass (all MoE layers) of the given tokens of `reqs`; returns its end time."""
    E = cache.experts
    tokens = sum(len(r) for r in rows.values())
    context = float(np.mean([rows[r].stop for r in reqs]))
    for j in range(cache.layers):
        counts = {r: _count(trace.requests[r].experts[rows[r], j], E) for r in reqs}
        t_route = now + timer.attention_part(tokens, len(reqs), context, prefill)
        link.run_until(t_route)
        total = sum(counts.values())
        for e in np.flatnonzero(total):  # prefetched experts still on their way: late
            key = j * E + int(e)
            if cache.cached(key) and cache.unused_prefetch[key] and link.late(key, t_route):
                cache.stats.prefetch_late += 1
        needed, demand = cache.access(j, counts)
        _issue(cache, link, demand, t_route)
        _issue(cache, link, cache.plan_prefetch(j), t_route)
        ready = max([link.ready_at(j * E + e) for e in needed] + [t_route])
        now = ready + timer.experts(total)
    return now + timer.head(len(reqs))


def _count(experts: np.ndarray, n: int) -> np.ndarray:
    e = experts.reshape(-1)
    return np.bincount(e[e >= 0], minlength=n)


def _issue(cache: ExpertCache, link: LinkQueue, fetches: list[Fetch], t: float) -> None:
    for key in cache.evicted_now:
        if link.cancel(key):
            cache.stats.cancelled += 1
    for f in fetches:
        link.push(f, t)


def default_prefetch_budget(hw: HardwareSpec, model: ModelSpec, batch: int, dtype: str = "float16") -> int:
    """Prefetches per layer pass: as many experts as the link moves during one decode layer's
    compute. Where an expert takes longer to copy than a layer to compute (Mixtral's 352 MB
    experts on any PCIe link) that is 0: a prefetch could not arrive under compute, and every
    wrong one would hold the link while demand fetches wait (give --prefetch-per-layer to force)."""
    timer = PassTimer(hw, model, dtype)
    touched = np.full(min(model.num_experts, model.top_k * batch), 1)
    layer = timer.attention_part(batch, batch, 256.0, False) + timer.experts(touched)
    return int(layer / timer.copy)
