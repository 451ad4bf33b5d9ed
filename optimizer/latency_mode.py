"""HRM prediction of latency mode (a device expert cache for small batches), and the choice
between it and the throughput mode (CGOPipe) for a job.

Latency mode keeps the non-expert weights, the KV cache and the activations on one GPU and the
routed experts in as many device slots as the rest of its memory holds. Per decode step and MoE
layer the GPU computes the batch's tokens (QKV, attention over the KV cache, O projection,
router, the experts touched: E(1 - (1 - k/E)^B) of them), and every needed expert that is not
cached is fetched first, one after another over the link. Without a trace of the job's routing
the expected hit rate is the cache's share of all experts (each needed expert equally likely to
be any: uniform routing, a pessimistic estimate; a trace's simulation, `moelight simulate-cache`,
gives the real one). Prefill streams every expert of a layer the cache lacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hrm import attention_memory, costs
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec
from optimizer.cost_model import ALPHA


@dataclass
class LatencyPrediction:
    batch_size: int
    slots: int  # device expert slots
    hit_rate: float  # expected share of needed experts found in the cache
    prefill_seconds: float  # the job's prefill
    step_seconds: float  # one decode step (a token for each of the batch)
    end_to_end_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    fetch_seconds_per_layer: float  # expected cost of a decode layer pass's misses (fetched, or run on the CPU)
    compute_seconds_per_layer: float
    gpu_memory_bytes: float = 0.0  # the weights, KV cache, activations and expert slots the GPU holds

    def to_dict(self) -> dict:
        return dict(self.__dict__) | {"tpot_ms": 1e3 * self.step_seconds}


def held_bytes(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, batch: int, dtype: str) -> float:
    """What one GPU holds besides its expert slots: the non-expert weights, the batch's KV cache (the pool the
    engine allocates and the device copies: wl.pool_tokens, each shared prefix once), the larger of a
    prefill's activations (its attention's temporaries too) and a decode step's attention temporaries (both
    grow with the batch), and the logits in float32."""
    b = dtype_bytes(dtype)
    kv = costs.kv_cache_bytes(m, 1.0, wl.pool_tokens(batch), dtype, layers=m.num_layers)
    pass_tokens = wl.prefill_pass_tokens(batch)
    prefill = ops.pass_activation_bytes(m, b, pass_tokens) + attention_memory.prefill_attention_scratch_bytes(
        m, pass_tokens / max(1.0, wl.peak_prompt), wl.peak_prompt, hw.gpu.memory_bytes)
    decode = attention_memory.decode_attention_scratch_bytes(m, b, batch, wl.max_context)
    act = max(float(prefill), float(decode)) + batch * m.vocab_size * 4.0
    return m.non_expert_params() * b + float(kv) + act


def cache_slots(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, batch: int, dtype: str,
                alpha: float = ALPHA) -> int:
    """Expert slots that fit on one GPU beside what it holds for the batch (held_bytes); 0 when not even
    one layer's experts fit."""
    room = alpha * hw.gpu.memory_bytes - held_bytes(hw, m, wl, batch, dtype)
    expert = m.expert_params() * m.expert_weight_bytes(dtype_bytes(dtype))
    total = (m.num_layers - m.num_dense_layers) * m.num_experts
    slots = min(total, int(max(0.0, room) // expert))
    return slots if slots >= m.num_experts else 0


def predict_latency_mode(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, requests: int, batch: int,
                         dtype: str, slots: int | None = None, hit_rate: float | None = None,
                         cpu_offload: bool = False) -> LatencyPrediction:
    """The job (`requests` in batches of `batch`) in latency mode; ValueError when it cannot run.
    cpu_offload: a miss runs where it is done sooner, fetched to the GPU or on the CPU next to its
    host copy (CoServe's K*n + B placement, the combined policy's)."""
    if not hw.has_gpu:
        raise ValueError(f"hardware {hw.name!r} has no GPU: latency mode keeps its expert cache on one")
    slots = cache_slots(hw, m, wl, batch, dtype) if slots is None else slots
    if slots < m.num_experts:
        raise ValueError(f"latency mode at batch {batch}: one {hw.gpu.name} cannot hold the non-expert weights, "
                         f"the KV cache and one layer's {m.num_experts} experts")
    moe_layers = m.num_layers - m.num_dense_layers
    h = min(1.0, slots / (moe_layers * m.num_experts)) if hit_rate is None else hit_rate
    gpu, b = hw.gpu, dtype_bytes(dtype)
    t = lambda c: float(costs.op_time(c, gpu, dtype))  # noqa: E731
    fetch = ops.expert_ffn(m, 0, b).bytes / hw.link.h2d

    def layer(tokens: float, seqs: float, attention) -> tuple[float, float]:
        touched = float(ops.experts_touched(m, tokens))
        per = m.top_k * tokens / max(touched, 1e-9)
        expert = t(ops.expert_ffn(m, per, b))
        compute = (t(ops.qkv_proj(m, tokens, b)) + t(attention) + t(ops.o_proj(m, tokens, b))
                   + t(ops.router(m, tokens, b)) + touched * h * expert)  # hits; misses below
        miss = fetch + expert
        if cpu_offload:  # the expert next to its host copy, the tokens over the link and back
            moved = 2 * per * m.hidden_size * b / hw.link.h2d
            miss = min(miss, float(costs.expert_time(m, per, hw.cpu, dtype)) + moved)
        return compute, touched * (1.0 - h) * miss * m.sparse_fraction

    # each layer pass pays the GPU's measured dispatch cost, each step the driving level's fixed one
    passes = float(costs.layer_overhead_time(hw, m.num_layers, "gpu"))
    dec_c, dec_f = layer(batch, batch, ops.decode_attention(m, batch, wl.mean_context, b))
    step = m.num_layers * (dec_c + dec_f) + t(ops.lm_head(m, batch, b)) + passes \
        + float(costs.step_overhead_time(hw, 1.0, "gpu")) + float(costs.sequence_step_time(hw, batch)) \
        + float(costs.logits_to_host_time(hw, m, batch))  # the host samples from the GPU's logits
    prompt = wl.effective_prompt
    pre_c, pre_f = layer(batch * prompt, batch, ops.prefill_attention(m, batch, prompt, b))
    prefill_batch = m.num_layers * (pre_c + pre_f) + passes
    g = wl.gen_len
    sizes = [batch] * (requests // batch) + ([requests % batch] if requests % batch else [])
    t_pre = sum(prefill_batch * n / batch for n in sizes)
    t_dec = sum((g - 1) * step for _ in sizes)
    total = t_pre + t_dec
    memory = held_bytes(hw, m, wl, batch, dtype) + slots * m.expert_params() * m.expert_weight_bytes(b)
    return LatencyPrediction(batch, slots, h, t_pre, step, requests * g / total, requests * prompt / max(t_pre, 1e-12),
                             batch / step, dec_f, dec_c, memory)


def best_latency_batch(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, requests: int, dtype: str,
                       limit: int = 64, cpu_offload: bool = False,
                       slots: int | None = None) -> LatencyPrediction | None:
    """Latency mode at its best batch size (powers of two up to `limit` and the job's size), or None;
    with `slots` (a cache size asked for), among the batches whose KV cache leaves room for them."""
    best = None
    cands = sorted({min(requests, 2**i) for i in range(int(math.log2(limit)) + 1)})
    for batch in cands:
        if slots is not None and cache_slots(hw, m, wl, batch, dtype) < slots:
            continue
        try:
            p = predict_latency_mode(hw, m, wl, requests, batch, dtype, slots=slots, cpu_offload=cpu_offload)
        except ValueError:
            continue
        if best is None or p.end_to_end_tokens_per_s > best.end_to_end_tokens_per_s:
            best = p
    return best
