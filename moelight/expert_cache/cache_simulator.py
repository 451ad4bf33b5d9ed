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

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hrm import costs
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from moelight.expert_cache.cache_policy import CachePolicy
from moelight.expert_cache.cache_state import CacheStats, ExpertCache, Fetch
from moelight.expert_cache.link_queue import LinkQueue
from moelight.expert_cache.routing_trace import Trace, TraceError


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
    """HRM seconds of a layer pass's parts on one GPU (latency mode runs on one device), and of an
    expert run on the CPU next to its host copy (tokens over the link and back)."""

    def __init__(self, hw: HardwareSpec, m: ModelSpec, dtype: str) -> None:
        if not hw.has_gpu:
            raise ValueError(f"hardware {hw.name!r} has no GPU: an expert cache lives on a GPU")
        self.gpu, self.cpu, self.m, self.b, self.dtype = hw.gpu, hw.cpu, m, dtype_bytes(dtype), dtype
        self.link = hw.link
        self.copy = ops.expert_ffn(m, 0, self.b).bytes / hw.link.h2d

    def cpu_expert(self, tokens: int) -> float:
        """K*n + B on the CPU (CoServe's placement cost), plus the tokens' round trip over the link."""
        moved = tokens * self.m.hidden_size * self.b
        return (float(costs.expert_time(self.m, tokens, self.cpu, self.dtype))
                + moved / self.link.d2h + moved / self.link.h2d)

    def cpu_crossover(self) -> int:
        """The most tokens for which a missed expert is done sooner on the CPU than fetched and run on
        the GPU (0: never)."""
        n = 0
        while n < 4096 and self.cpu_expert(n + 1) < self.copy + self.experts(np.array([n + 1])):
            n += 1
        return n

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
        raise TraceError(f"the trace routes {L} MoE layers x {tm.num_experts} experts ({tm.name}), {model.name} has "
                         f"{model.num_layers - model.num_dense_layers} x {model.num_experts}: leave --model out to "
                         "use the trace's own model, or trace the model you want to simulate")
    timer = PassTimer(hw, model, dtype)
    policy = make_policy()
    if policy.wants_hidden and any(r.hidden is None for r in trace.requests):
        raise TraceError(f"policy {policy.name} reads hidden states: record the trace with `moelight trace --hidden`")
    budget = default_prefetch_budget(hw, model, batch, dtype) if prefetch_per_layer is None else prefetch_per_layer
    cache = ExpertCache(L, tm.num_experts, slots, policy, budget if policy.predicts else 0,
                        cpu_max_tokens=timer.cpu_crossover() if policy.cpu_offload else 0,
                        prefetch_given=prefetch_per_layer is not None)
    link = LinkQueue(timer.copy, ops.expert_ffn(model, 0, timer.b).bytes, cache.stats, policy.copy_chunks)
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
    E, policy = cache.experts, cache.policy
    tokens = sum(len(r) for r in rows.values())
    context = float(np.mean([rows[r].stop for r in reqs]))
    for j in range(cache.layers):
        counts = {r: _count(trace.requests[r].experts[rows[r], j], E) for r in reqs}
        total = sum(counts.values())
        t_route = now + timer.attention_part(tokens, len(reqs), context, prefill)
        if policy.wants_hidden:
            routed = [trace.requests[r].hidden[rows[r], j][trace.requests[r].experts[rows[r], j, 0] >= 0]
                      for r in reqs]
            policy.observe_hidden(j, np.concatenate(routed))
        if prefill and policy.stream_prefill:  # DuoServe: the prefill bypasses the cache
            policy.observe(j, counts)
            needed = np.flatnonzero(total)
            cache.stats.streamed += len(needed)
            now = link.stream(t_route, len(needed), [timer.experts(total[[e]]) for e in needed])
            continue
        link.run_until(t_route)
        for e in np.flatnonzero(total):  # prefetched experts still on their way: late
            key = j * E + int(e)
            if cache.cached(key) and cache.unused_prefetch[key] and link.late(key, t_route):
                cache.stats.prefetch_late += 1
        needed, demand = cache.access(j, counts)
        _issue(cache, link, demand, t_route)
        for e in needed:
            link.promote(j * E + e)
        on_cpu = set(cache.cpu_now)
        _issue(cache, link, cache.plan_prefetch(j), t_route)
        gpu = [e for e in needed if e not in on_cpu]
        ready = {e: max(t_route, link.ready_at(j * E + e)) for e in gpu}
        order = sorted(gpu, key=lambda e: (ready[e] > t_route, ready[e], e)) if policy.reorder else gpu
        t = t_route
        for e in order:
            t = max(t, ready[e]) + timer.experts(total[[e]])
        cpu_done = t_route + sum(timer.cpu_expert(int(total[e])) for e in on_cpu)
        now = max(t, cpu_done)
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
