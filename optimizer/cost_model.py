"""The HRM cost model of a policy, as affine pieces in (r_w, r_c) at fixed integers.

For fixed (mu, n_mb, A_g, F_g) every time and memory term below is affine in the two
continuous unknowns x = r_w (share of expert weights resident on the GPU) and
y = r_c (share of the KV cache resident on the GPU), so the per-point problem is an
LP. `build_point_model` evaluates all coefficients for a whole (mu, n_mb) grid at
once (numpy broadcasting); `Affine` pieces are (c0, cx, cy) arrays.

Per-layer decode time (DESIGN.md section 4), n = n_mb micro-batches of mu tokens, N = mu*n:
  T_layer = max(T_h2d(x, y), T_d2h(y), T_host(x, y), T_stage(x), max(T_cpu, T_gpu) + fill)
  T_h2d  = [F(1-x) W_layer_experts + A(1-y) KV_layer(N, c_mean) + cross-level activations
            + F all-reduce traffic over PCIe] / B_h2d + copies x the link's fixed cost per copy
  T_d2h  = [cross-level activations + A(1-y) new K/V of N tokens + F all-reduce traffic] / B_d2h + copies
  T_host = [3 F(1-x) W_layer_experts (pageable->pinned copy reads and writes, the DMA reads)
            + KV the CPU attention or the KV DMA reads + activations crossing] / B_cpu
  T_stage = F(1-x) W_layer_experts / the runtime's pageable->pinned copy rate (the first hop)
  T_gpu  = n * (F (pre + post + all-reduces)(mu) + A attention(mu, c_mean))    on the GPU
  T_cpu  = n * ((1-F)(pre + post)(mu) + (1-A) attention(mu, c_mean)) on the CPU
  fill   = max(0, chain - max(T_cpu, T_gpu)) where attention and the FFN run on different levels, with
           chain = (T_cpu + T_gpu) / n + one micro-batch's activations over the link and back: a
           micro-batch's layer runs its GPU work, its attention and its FFN in turn, and its next layer
           waits for them, so a layer pass takes at least that chain whatever the other micro-batches
           overlap (n = 1: the lanes add up, as CGOPipe's task graph runs them; many micro-batches:
           the busier lane binds)
  (pre + post include the driving level's fixed per-layer-pass overhead; GEMMs stream their
  weights at the level's achieved small-M rate, hrm.costs.op_time)
With t GPUs (tensor parallelism) the GPU level and the links are t-fold aggregates (hrm.hardware),
the two all-reduces per layer (O projection, FFN) cost 2(t-1)/t x bytes at the interconnect
rate (hrm.costs.allreduce_time), and the replicated weights (embeddings, norms, routers) and
activations are held t times. T_host is the host memory every link's DMA, the staging copies
and CPU attention draw from: with enough GPUs it, not the links, binds.
Prefill per layer (on the FFN level; weights streamed once per batch when the passes run
layer-major, once per pass when the runtime prefills in chunks: WorkloadSpec.prefill_chunk):
  T_pre_layer = max(n * prefill_layer(mu, prompt), T_weights_h2d(x), T_kv_d2h(y), T_pre_host(x), T_pre_stage(x))
End to end for one batch: T = L T_pre_layer + head + (gen-1) (L T_layer + head), where
head = n * (lm_head(mu) + per-step overhead) + N * the host's per-sequence step work
       + the host's passes over N rows of logits (widen, check, argmax)
       + (FFN on GPU) N rows of float32 logits over one GPU's link to the host sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np

from hrm import attention_memory, costs
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec

ALPHA = 0.9  # usable share of each memory (headroom for allocator, fragmentation, runtime)


@dataclass
class Affine:
    """c0 + cx * r_w + cy * r_c, each an array over the grid."""

    c0: np.ndarray
    cx: np.ndarray
    cy: np.ndarray

    def at(self, x, y):
        return self.c0 + self.cx * x + self.cy * y


def _aff(c0, cx=0.0, cy=0.0, shape=()) -> Affine:
    return Affine(*(np.broadcast_to(np.asarray(v, float), shape).astype(float) for v in (c0, cx, cy)))


@dataclass
class PointModel:
    """All coefficients of the per-point LP for a grid of (mu, n_mb) at fixed (A_g, F_g)."""

    mu: np.ndarray
    n_mb: np.ndarray
    a_g: int
    f_g: int
    num_layers: int
    gen_len: int
    prompt: float
    x_max: float
    y_max: float
    t_gpu: np.ndarray
    t_cpu: np.ndarray
    h2d: Affine
    d2h: Affine
    host: Affine
    stage: Affine
    pre_comp: np.ndarray
    pre_h2d: Affine
    pre_d2h: Affine
    pre_host: Affine
    pre_stage: Affine
    head_pre: np.ndarray
    head_dec: np.ndarray
    gpu_mem: dict[str, Affine] = field(default_factory=dict)
    cpu_mem: dict[str, Affine] = field(default_factory=dict)
    gpu_cap: float = 0.0
    cpu_cap: float = 0.0
    fill: np.ndarray | float = 0.0  # what a micro-batch's own chain through a layer adds to the busier lane

    @property
    def compute(self) -> np.ndarray:
        """The compute side of T_layer: the busier lane, and the fill before the lanes overlap."""
        return np.maximum(self.t_cpu, self.t_gpu) + self.fill

    @property
    def batch(self) -> np.ndarray:
        return self.mu * self.n_mb

    def gpu_total(self) -> Affine:
        return _sum(self.gpu_mem, self.mu.shape)

    def cpu_total(self) -> Affine:
        return _sum(self.cpu_mem, self.mu.shape)

    @property
    def decode_roofs(self) -> tuple[Affine, ...]:
        """The per-layer decode terms affine in (r_w, r_c): link directions, host memory, staging copy."""
        return self.h2d, self.d2h, self.host, self.stage

    @property
    def prefill_roofs(self) -> tuple[Affine, ...]:
        return self.pre_h2d, self.pre_d2h, self.pre_host, self.pre_stage

    # ---- evaluation at given (x, y) ----
    def layer_times(self, x, y) -> dict[str, np.ndarray]:
        h2d, d2h, host, stage = (a.at(x, y) for a in self.decode_roofs)
        link = np.maximum(h2d, d2h)
        moved = np.maximum(np.maximum(link, host), stage)
        return {"T_h2d": h2d, "T_d2h": d2h, "T_link": link, "T_host": host, "T_stage": stage,
                "T_cpu": self.t_cpu, "T_gpu": self.t_gpu, "T_fill": self.fill + np.zeros(np.shape(self.t_cpu)),
                "T_layer": np.maximum(moved, self.compute)}

    @property
    def nothing_on_gpu(self) -> bool:
        """Neither weights nor KV can be placed on a GPU: the (r_w, r_c) box is the point (0, 0)."""
        return self.x_max == 0 and self.y_max == 0

    def prefill_time(self, x, y):
        moved = np.max([a.at(x, y) * np.ones_like(self.pre_comp) for a in self.prefill_roofs], axis=0)
        return self.prefill_time_of(np.maximum(self.pre_comp, moved))

    def prefill_time_of(self, layer):
        """Prefill time from one layer pass's time: every layer, then the LM head."""
        return self.num_layers * layer + self.head_pre

    def decode_step_time(self, x, y):
        return self.step_time_of(self.layer_times(x, y)["T_layer"])

    def step_time_of(self, layer):
        """A decode step's time from one layer pass's time: every layer, then the LM head and sampling."""
        return self.num_layers * layer + self.head_dec

    def total_time(self, x, y):
        return self.prefill_time(x, y) + (self.gen_len - 1) * self.decode_step_time(x, y)

    def take(self, i) -> PointModel:
        """The model at grid points `i` (indices into the flat grid): every per-point array indexed."""
        def at(v):
            if isinstance(v, Affine):
                return Affine(at(v.c0), at(v.cx), at(v.cy))
            if isinstance(v, dict):
                return {k: at(a) for k, a in v.items()}
            return v[i] if isinstance(v, np.ndarray) and v.shape == self.mu.shape else v

        return replace(self, **{f.name: at(getattr(self, f.name)) for f in fields(self)})

    def throughput(self, x, y):
        """End-to-end generated tokens per second: N * gen_len / (prefill + decode)."""
        return self.batch * self.gen_len / self.total_time(x, y)


def binding_roof(layer_times: dict) -> str:
    """Which term sets T_layer: "link", "host", "stage" (the pinned-buffer copy), "cpu" or "gpu"."""
    fill = layer_times.get("T_fill", 0.0)  # the compute side's fill counts with its busier lane
    parts = {"link": layer_times["T_link"], "host": layer_times["T_host"], "stage": layer_times["T_stage"],
             "cpu": layer_times["T_cpu"] + fill, "gpu": layer_times["T_gpu"] + fill}
    return max(parts, key=parts.get)


def _sum(d: dict[str, Affine], shape) -> Affine:
    out = _aff(0.0, shape=shape)
    for a in d.values():
        out = Affine(out.c0 + a.c0, out.cx + a.cx, out.cy + a.cy)
    return out


def build_point_model(hw: HardwareSpec, m: ModelSpec, wl: WorkloadSpec, dtype: str, mu, n_mb,
                      a_g: int, f_g: int, alpha: float = ALPHA) -> PointModel:
    """Coefficients of the LP at every (mu, n_mb) (arrays broadcast together) for (A_g, F_g)."""
    mu, n_mb = np.broadcast_arrays(np.asarray(mu, float), np.asarray(n_mb, float))
    shape = mu.shape
    has_gpu = hw.has_gpu
    if not has_gpu and (a_g or f_g):
        raise ValueError("A_g/F_g = 1 needs a GPU")
    b = dtype_bytes(dtype)
    big_n = mu * n_mb
    L, g = m.num_layers, wl.gen_len
    p = wl.effective_prompt
    p_new = wl.computed_prompt  # what prefill computes and stores (a shared prefix only once)
    c_mean, c_max = wl.mean_context, wl.max_context
    ffn_lvl = "gpu" if f_g else "cpu"
    att_lvl = "gpu" if a_g else "cpu"

    w_le = costs.layer_expert_bytes(m, dtype)
    w_e = L * w_le
    w_moe = float(m.moe_layer_expert_params() * m.expert_weight_bytes(b))  # a buffer holds a MoE layer's
    non_exp = float(m.non_expert_params() * b)
    copies = costs.kv_copies(hw, m)  # MLA under TP: every rank keeps (and reads) its own latent
    kv_mean_layer = costs.kv_cache_bytes(m, big_n, c_mean, dtype, copies=copies)
    # the pool the engine reserves for N sequences at once, as the memory check counts it (a job's shared
    # prefixes once per distinct prefix live at once: WorkloadSpec.kv_pool)
    kv_total = costs.kv_cache_bytes(m, 1.0, wl.pool_tokens(big_n), dtype, layers=L, copies=copies)
    kv_mb_layer = costs.kv_cache_bytes(m, mu, c_max, dtype)
    new_kv = costs.kv_cache_bytes(m, big_n, 1, dtype, copies=copies)
    qkv_n, out_n = costs.qkv_bytes(m, big_n, dtype), costs.attention_output_bytes(m, big_n, dtype)
    zeros = np.zeros(shape)

    # ---- decode compute ----
    pre_post = costs.pre_attention_time(hw, m, mu, ffn_lvl, dtype) + costs.post_attention_time(
        hw, m, mu, ffn_lvl, dtype)
    att = costs.attention_time(hw, m, mu, c_mean, att_lvl, dtype)
    # fixed dispatch cost of a layer pass, charged to the level that drives the layer (the FFN's)
    pre_post = pre_post + costs.runtime_layer_time(hw, 1.0, ffn_lvl)
    # tensor parallelism: the layer's two all-reduces hold the GPU stream (zero on one GPU)
    reduce = costs.layer_allreduce_time(hw, m, mu, dtype) if f_g else 0.0
    # quantized experts: the GPU dequantizes the layer's experts once per layer pass before its GEMMs
    # (none where it multiplies them as they are: hw.gpu.fused_dequant)
    dequant = costs.expert_dequantize_time(hw, m, dtype) if f_g else 0.0
    t_gpu = n_mb * (f_g * (pre_post + reduce) + a_g * att) + dequant + zeros
    t_cpu = n_mb * ((1 - f_g) * pre_post + (1 - a_g) * att) + zeros

    # ---- link and host memory (seconds), zero on a CPU-only host ----
    kv_pre = costs.kv_cache_bytes(m, big_n, p_new, dtype, copies=copies)
    passes = wl.prefill_passes(mu, n_mb)  # prefill passes per batch (their dispatch overhead)
    loads = wl.prefill_weight_loads(mu, n_mb)  # how often prefill streams the paged weights
    if has_gpu:
        link = hw.link_total()
        bh, bd, bc = link.h2d, link.d2h, hw.host_memory_bandwidth()
        cross_h2d = f_g * (1 - a_g) * out_n + a_g * (1 - f_g) * qkv_n
        cross_d2h = f_g * (1 - a_g) * qkv_n + a_g * (1 - f_g) * out_n
        ring = f_g * n_mb * costs.allreduce_link_bytes(hw, m, mu, dtype)  # over PCIe: on the links too
        # the fixed cost of every copy of a layer: weight pages and activations per micro-batch, KV
        crossing = f_g * (1 - a_g) + a_g * (1 - f_g)
        lat_h2d = link.latency_s * n_mb * (f_g + crossing + a_g)
        lat_d2h = link.latency_s * n_mb * (crossing + a_g)
        h2d = _aff((f_g * w_le + a_g * kv_mean_layer + cross_h2d + ring) / bh + lat_h2d, -f_g * w_le / bh,
                   -a_g * kv_mean_layer / bh, shape)
        d2h = _aff((cross_d2h + a_g * new_kv + ring) / bd + lat_d2h, 0.0, -a_g * new_kv / bd, shape)
        paging = costs.STAGING_PASSES * f_g * w_le
        # the CPU attention reads the whole KV cache; with attention on the GPU the DMA reads its CPU share
        host = _aff((paging + kv_mean_layer + a_g * new_kv + cross_h2d + cross_d2h) / bc, -paging / bc,
                    -a_g * kv_mean_layer / bc, shape)
        # the first paging hop (pageable -> pinned) at the runtime's copy rate: a roof of its own
        stage = _aff(f_g * w_le / hw.staging_rate(), -f_g * w_le / hw.staging_rate(), 0.0, shape)
        pre_ring = f_g * n_mb * costs.allreduce_link_bytes(hw, m, mu * p_new, dtype)
        if f_g:  # prefill on GPU: stream the CPU share of the experts (per pass or per batch), KV goes back
            pre_h2d = _aff((loads * w_le + pre_ring) / bh, -loads * w_le / bh, 0.0, shape)
            pre_d2h = _aff((kv_pre + pre_ring) / bd, 0.0, -a_g * kv_pre / bd, shape)
            pre_host = _aff((loads * paging + 2 * kv_pre) / bc, -loads * paging / bc, -2 * a_g * kv_pre / bc,
                            shape)
            pre_stage = _aff(loads * w_le / hw.staging_rate(), -loads * w_le / hw.staging_rate(), 0.0, shape)
        else:  # prefill on CPU; only the GPU-resident KV share crosses
            pre_h2d = _aff(0.0, 0.0, a_g * kv_pre / bh, shape)
            pre_d2h = _aff(0.0, shape=shape)
            pre_host = _aff(0.0, 0.0, a_g * kv_pre / bc, shape)
            pre_stage = _aff(0.0, shape=shape)
    else:
        h2d = d2h = host = stage = pre_h2d = pre_d2h = pre_host = pre_stage = _aff(0.0, shape=shape)

    pre_reduce = costs.layer_allreduce_time(hw, m, mu * p_new, dtype) if f_g else 0.0
    pre_comp = n_mb * (costs.prefill_layer_time(hw, m, mu, max(p_new, 1.0), ffn_lvl, dtype) + pre_reduce) \
        + costs.runtime_layer_time(hw, passes, ffn_lvl) + zeros
    head = n_mb * (costs.lm_head_time(hw, m, mu, ffn_lvl, dtype)
                   + costs.step_overhead_time(hw, 1.0, ffn_lvl)) + costs.sequence_step_time(hw, big_n) \
        + costs.logits_passes_time(hw, m, big_n) + zeros
    if has_gpu and f_g:  # the head ran on the GPU: every micro-batch's logits cross to the host sampler
        head = head + costs.logits_to_host_time(hw, m, big_n, copies=n_mb)
    # prefill faults in the batch's fresh KV pool on the host as its first writes land on its pages, spread over
    # all of it: the pool the engine reserves, every sequence's prompt and generation (with the cache on a GPU,
    # a_g, the host pool is not the one written: not charged)
    first_touch = (1 - a_g) * costs.kv_first_touch_time(hw, kv_total)

    # ---- memory (bytes) ----
    act = ops.pass_activation_bytes(m, b, wl.prefill_pass_tokens(mu)) + mu * m.vocab_size * 4.0  # + fp32 logits
    gpu_mem: dict[str, Affine] = {}
    cpu_mem: dict[str, Affine] = {}
    t = hw.gpu_count if has_gpu else 1  # tensor parallel: every GPU holds the replicated weights, activations
    if f_g:
        gpu_mem["non_expert_weights"] = _aff(non_exp + (t - 1) * m.replicated_params() * b, shape=shape)
        gpu_mem["resident_experts"] = _aff(0.0, w_e, 0.0, shape)
        gpu_mem["paged_weight_buffers"] = _aff(2 * w_moe, -2 * w_moe, 0.0, shape)
        if m.expert_bits and not hw.gpu.fused_dequant:  # quantized: one MoE layer expanded for its GEMMs
            gpu_mem["dequantized_layer"] = _aff(float(m.moe_layer_expert_params() * b), shape=shape)
    if f_g or a_g:
        gpu_mem["activations"] = _aff(t * act, shape=shape)
    if f_g:  # prefill attention runs on the GPU: its largest group call's scores, keys and values (per rank:
        seqs = wl.prefill_pass_tokens(mu) / max(1.0, wl.peak_prompt) / t  # its share of the heads)
        gpu_mem["prefill_attention_scratch"] = _aff(t * attention_memory.prefill_attention_scratch_bytes(
            m, seqs, wl.peak_prompt, hw.gpu.memory_bytes), shape=shape)
    if a_g:
        gpu_mem["kv_cache"] = _aff(0.0, 0.0, kv_total, shape)
        gpu_mem["kv_prefetch_buffers"] = _aff(2 * kv_mb_layer, 0.0, -2 * kv_mb_layer, shape)
    if not f_g:
        cpu_mem["non_expert_weights"] = _aff(non_exp + m.host_weight_extra_bytes, shape=shape)
        if a_g:  # attention on the GPU: its micro-batch's float32 logits come back to the host
            cpu_mem["activations"] = _aff(act, shape=shape)
        else:  # all on the CPU: its largest pass and the batch's sampled logits, as the memory check counts them
            run_act = ops.host_run_activation_bytes(m, b, wl.prefill_pass_tokens(mu), big_n, wl.argmax_only)
            cpu_mem["activations"] = _aff(run_act, shape=shape)
    cpu_mem["experts"] = _aff(w_e, -f_g * w_e, 0.0, shape)
    cpu_mem["kv_cache"] = _aff(kv_total, 0.0, -a_g * kv_total, shape)
    if f_g:
        cpu_mem["pinned_weight_pages"] = _aff(2 * w_moe / n_mb, -2 * w_moe / n_mb, 0.0, shape)
    if has_gpu and (f_g or a_g):
        cpu_mem["pinned_activations"] = _aff(qkv_n + out_n, shape=shape)

    if has_gpu and f_g != a_g:  # a micro-batch's own chain through the layer: its lanes run in turn
        chain = (t_cpu + t_gpu + cross_h2d / bh + cross_d2h / bd) / n_mb + 2.0 * link.latency_s
        fill = np.maximum(0.0, chain - np.maximum(t_cpu, t_gpu))
    else:
        fill = zeros
    gpu = hw.gpu_total()
    return PointModel(
        mu=mu, n_mb=n_mb, a_g=a_g, f_g=f_g, num_layers=L, gen_len=g, prompt=p,
        x_max=1.0 if f_g else 0.0, y_max=1.0 if a_g else 0.0,
        t_gpu=t_gpu, t_cpu=t_cpu, h2d=h2d, d2h=d2h, host=host, stage=stage, pre_comp=pre_comp,
        pre_h2d=pre_h2d, pre_d2h=pre_d2h, pre_host=pre_host, pre_stage=pre_stage,
        head_pre=head + first_touch, head_dec=head,
        gpu_mem=gpu_mem, cpu_mem=cpu_mem,
        gpu_cap=alpha * gpu.memory_bytes if gpu is not None else 0.0,
        cpu_cap=alpha * hw.cpu.memory_bytes, fill=fill,
    )
