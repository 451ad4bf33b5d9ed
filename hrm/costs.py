"""Time costs of the CGOPipe tasks, in seconds, for a HardwareSpec / ModelSpec / dtype.

This is the contract between HRM and its users: the optimizer's cost model and the
CGOPipe simulator (which times a task graph with these numbers) both call it.

Rules, all from the Hierarchical Roofline Model (DESIGN.md section 3):
- A compute task runs on `where` = "gpu" or "cpu" with its data resident there. Each
  kernel's time is max(FLOPs / P, bytes / B) with P the level's peak FLOP/s for `dtype`
  and B its memory bandwidth; a task made of several kernels sums their times.
- The element-wise work between the GEMMs (norms, rotary, residuals, the MoE gather /
  SiLU / scale / scatter) adds bytes / B_elem where the level has a measured element-wise
  rate (a `moelight profile`); datasheet levels treat it as fused (zero), like the paper.
- "gpu" means all GPUs of the host as one (tensor parallelism: t x FLOP/s, bandwidth).
- Transfers take bytes / link bandwidth in their direction; the two directions are
  independent (a simulator may overlap them), one direction is serial.
- Counts (mu, seqs, context) may be numpy arrays; results are then arrays.

Task boundaries match CGOPipe (DESIGN.md section 5):
- pre-attention(mu): input RMSNorm + QKV projection (+ rotary) of mu tokens,
- attention(mu, c): decode attention of mu sequences at context c (reads their KV cache),
- post-attention(mu): O projection + residual + RMSNorm + router + MoE FFN with the
  layer's experts resident on that level (only the experts the mu tokens touch are read).
"""

from __future__ import annotations

import numpy as np

from hrm import latent_attention
from hrm import operators as ops
from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec, Level
from hrm.model import ModelSpec

DEFAULT_DTYPE = "bfloat16"
# host-memory passes per paged weight byte: the copy into the pinned buffer reads and writes it,
# the link's DMA reads the pinned copy (DESIGN.md section 5's two hops)
STAGING_PASSES = 3


def level_of(hw: HardwareSpec, where: str) -> Level:
    """The Level object for "gpu" (all GPUs aggregated) or "cpu"."""
    if where == "cpu":
        return hw.cpu
    if where == "gpu":
        lvl = hw.gpu_total()
        if lvl is None:
            raise ValueError(f"hardware {hw.name!r} has no GPU")
        return lvl
    raise ValueError(f"where must be 'gpu' or 'cpu', not {where!r}")


def op_time(cost: ops.OpCost, level: Level, dtype: str = DEFAULT_DTYPE, peak=None, bandwidth=None):
    """Roofline time of one kernel on `level`: max(FLOPs / P_level, bytes / B_level).

    A GEMM (cost.rows set) runs at the level's measured FLOP/s for its M when the level
    has a GEMM curve, and streams its bytes at the level's GEMM bandwidth (what a kernel
    with few rows per weight reaches, below a copy's rate); `peak` / `bandwidth` override
    both for special kernels (attention).
    """
    p = peak if peak is not None else level.gemm_peak(dtype, cost.rows)
    if bandwidth is None:
        bandwidth = level.weight_stream_bandwidth() if cost.rows is not None else level.bandwidth
    return np.maximum(np.asarray(cost.flops, float) / p, np.asarray(cost.bytes, float) / bandwidth)


def moe_ffn_time(m: ModelSpec, tokens, lvl: Level, dtype: str = DEFAULT_DTYPE):
    """A layer's FFN on `tokens` tokens at the level's expert-kernel rate (its GEMM rate without one)."""
    cost = ops.moe_ffn(m, tokens, dtype_bytes(dtype))
    return op_time(cost, lvl, dtype, peak=lvl.expert_peak(dtype, cost.rows, m.expert_format))


def expert_time(m: ModelSpec, tokens, lvl: Level, dtype: str = DEFAULT_DTYPE):
    """One routed expert on `tokens` tokens at the level's expert-kernel rate."""
    cost = ops.expert_ffn(m, tokens, dtype_bytes(dtype))
    return op_time(cost, lvl, dtype, peak=lvl.expert_peak(dtype, cost.rows, m.expert_format))


def elementwise_time(cost: ops.OpCost, level: Level):
    """Element-wise work at the level's measured element-wise rate. Levels without one (the
    datasheet presets) count it as fused into the GEMMs, as the paper's HRM does: zero."""
    if not level.elementwise_bandwidth:
        return 0.0 * np.asarray(cost.bytes, float)
    return np.asarray(cost.bytes, float) / level.elementwise_bandwidth


def _t(x):
    """Plain float for scalar inputs, array otherwise."""
    a = np.asarray(x, dtype=float)
    return float(a) if a.ndim == 0 else a


# ---- compute tasks ----
def pre_attention_time(hw: HardwareSpec, m: ModelSpec, mu, where: str = "gpu", dtype: str = DEFAULT_DTYPE):
    """Seconds for norm + QKV projection (+ rotary) of a micro-batch of mu tokens, one layer."""
    b, lvl = dtype_bytes(dtype), level_of(hw, where)
    return _t(op_time(ops.qkv_proj(m, mu, b), lvl, dtype)
              + elementwise_time(ops.pre_attention_elementwise(m, mu, b), lvl))


def attention_time(hw: HardwareSpec, m: ModelSpec, mu, context, where: str = "cpu",
                   dtype: str = DEFAULT_DTYPE):
    """Seconds for decode attention of mu sequences at `context` tokens each, one layer,
    KV cache resident on `where` (the CPU in CGOPipe). Its compute roof is the attention kernels'
    measured rate, not the GEMM peak: MLA's absorbed decode (~30 FLOP a byte) is bound by it."""
    lvl = level_of(hw, where)
    cost = ops.decode_attention(m, mu, context, dtype_bytes(dtype))
    copies = kv_copies(hw, m) if where == "cpu" else 1  # MLA under TP: each rank reads its own latent copy
    cost = ops.OpCost(cost.flops, cost.bytes * copies)
    return _t(op_time(cost, lvl, dtype, peak=lvl.attention_peak(dtype), bandwidth=lvl.attention_bandwidth or None))


def post_attention_time(hw: HardwareSpec, m: ModelSpec, mu, where: str = "gpu", dtype: str = DEFAULT_DTYPE):
    """Seconds for O proj + residual + norm + router + MoE FFN of mu tokens, one layer,
    with the layer's expert weights resident on `where`."""
    b, lvl = dtype_bytes(dtype), level_of(hw, where)
    total = (op_time(ops.o_proj(m, mu, b), lvl, dtype) + op_time(ops.router(m, mu, b), lvl, dtype)
             + moe_ffn_time(m, mu, lvl, dtype)
             + elementwise_time(ops.post_attention_elementwise(m, mu, b), lvl))
    return _t(total)


def prefill_layer_time(hw: HardwareSpec, m: ModelSpec, seqs, prompt, where: str = "gpu",
                       dtype: str = DEFAULT_DTYPE):
    """Seconds for one layer of prefill of `seqs` prompts of `prompt` tokens (one micro-batch):
    pre-attention + causal attention + post-attention on seqs*prompt tokens."""
    b, lvl = dtype_bytes(dtype), level_of(hw, where)
    tokens = np.asarray(seqs, float) * np.asarray(prompt, float)
    total = (op_time(ops.qkv_proj(m, tokens, b, prefill=True), lvl, dtype)
             + op_time(ops.prefill_attention(m, seqs, prompt, b), lvl, dtype, peak=lvl.attention_peak(dtype))
             + op_time(ops.o_proj(m, tokens, b, prefill=True), lvl, dtype)
             + op_time(ops.router(m, tokens, b), lvl, dtype)
             + moe_ffn_time(m, tokens, lvl, dtype)
             + elementwise_time(ops.pre_attention_elementwise(m, tokens, b), lvl)
             + elementwise_time(ops.post_attention_elementwise(m, tokens, b), lvl))
    return _t(total)


def expert_dequantize_time(hw: HardwareSpec, m: ModelSpec, dtype: str = DEFAULT_DTYPE):
    """Seconds a GPU spends dequantizing one layer's quantized experts per layer pass (0 for 16-bit, and
    on a GPU that multiplies them as they are: hw.gpu.fused_dequant)."""
    if not m.expert_bits or not hw.has_gpu or hw.gpu.fused_dequant:
        return 0.0
    return float(op_time(ops.expert_dequantize(m, dtype_bytes(dtype)), level_of(hw, "gpu"), dtype))


def layer_overhead_time(hw: HardwareSpec, passes, where: str = "cpu"):
    """Fixed dispatch cost (Python, kernel launches) of `passes` layer passes on `where`."""
    return _t(np.asarray(passes, float) * level_of(hw, where).layer_overhead_s)


def runtime_layer_time(hw: HardwareSpec, passes, where: str = "cpu"):
    """Fixed cost of `passes` layer passes through the CGOPipe runtime on `where`: its measured cost
    per pass where `moelight profile` took it, which includes the kernel launches, else theirs."""
    lvl = level_of(hw, where)
    return _t(np.asarray(passes, float) * max(lvl.layer_overhead_s, lvl.runtime_layer_s))


def step_overhead_time(hw: HardwareSpec, passes, where: str = "cpu"):
    """Fixed per-step cost outside the layers (embedding, sampling, bookkeeping) of `passes`
    micro-batch steps driven from `where`."""
    return _t(np.asarray(passes, float) * level_of(hw, where).step_overhead_s)


def sequence_step_time(hw: HardwareSpec, sequences):
    """The host's per-sequence work of one decode step (scheduling, block tables, sampling, results)
    for `sequences` sequences: serial with the step, on the CPU whether or not a GPU runs the layers."""
    return _t(np.asarray(sequences, float) * hw.cpu.sequence_step_s)


def lm_head_time(hw: HardwareSpec, m: ModelSpec, tokens, where: str = "gpu", dtype: str = DEFAULT_DTYPE):
    """Seconds for final norm + lm_head on `tokens` tokens (once per decode step per token). The
    LM head is replicated under tensor parallelism: every GPU computes all logits, at one GPU's rate."""
    lvl = hw.gpu if where == "gpu" and hw.has_gpu else level_of(hw, where)
    return _t(op_time(ops.lm_head(m, tokens, dtype_bytes(dtype)), lvl, dtype))


LOGITS_BYTES = 4.0  # float32 logits per vocabulary entry: the host samples from them
# bytes a logit costs the host's passes over a step's logits: the LM head's bf16 output read and widened
# to float32 (2 + 4), the finiteness check's sum and the greedy argmax read the float32 logits (4 + 4)
LOGIT_PASS_BYTES = 14.0


def logits_passes_time(hw: HardwareSpec, m: ModelSpec, tokens):
    """Seconds of the host's passes over `tokens` rows of logits (moelight.engine.generation._accept and
    the sampler's greedy argmax) at the CPU's measured rate for them; 0 where it was not measured. With
    the LM head on a GPU the widening runs there, but the host still reads the logits twice: charged alike."""
    rate = hw.cpu.logits_bandwidth
    n = np.asarray(tokens, float) * m.vocab_size * LOGIT_PASS_BYTES
    return _t(n / rate if rate else 0.0 * n)


def kv_first_touch_time(hw: HardwareSpec, nbytes):
    """Seconds the host spends faulting in `nbytes` of a fresh KV cache pool the first time the job writes
    them (page faults and zeroing, at the CPU's measured rate for the engine's pool; 0 where unmeasured).
    Paid once per pool, by the first pass, whose writes spread over all of it: on a 2-core AMX guest ~0.22 s
    of the README job's ~0.7 s prefill (a 327 MB pool), which no kernel term counts."""
    rate = hw.cpu.kv_first_touch_bandwidth
    n = np.asarray(nbytes, float)
    return _t(n / rate if rate else 0.0 * n)


def logits_to_host_time(hw: HardwareSpec, m: ModelSpec, tokens, copies=1):
    """Seconds to bring `tokens` rows of float32 logits from the GPU that computed them (one GPU's
    link, rank 0's under tensor parallelism) to the host sampler, in `copies` copies. At a large
    vocabulary (Qwen3's 152k) and thousands of sequences a step, this is a real share of it."""
    if not hw.has_gpu:
        return _t(np.zeros_like(np.asarray(tokens, float)))
    return _t(hw.link.copy_seconds(np.asarray(tokens, float) * m.vocab_size * LOGITS_BYTES, "d2h", copies))


# ---- tensor parallelism ----
def allreduce_bytes_per_gpu(hw: HardwareSpec, nbytes):
    """Bytes one GPU sends (and receives) in a ring all-reduce of `nbytes`: 2(t-1)/t x nbytes."""
    t = hw.gpu_count if hw.has_gpu else 1
    return _t(np.asarray(nbytes, float) * (2.0 * (t - 1) / t if t > 1 else 0.0))


def allreduce_time(hw: HardwareSpec, nbytes):
    """Seconds of a ring all-reduce of `nbytes` over the GPUs: 2(t-1)/t x nbytes at the interconnect's
    per-GPU bandwidth, plus 2(t-1) step latencies; zero on one GPU. The compute stream waits for it."""
    t = hw.gpu_count if hw.has_gpu else 1
    if t <= 1:
        return _t(0.0 * np.asarray(nbytes, float))
    return _t(allreduce_bytes_per_gpu(hw, nbytes) / hw.interconnect_bandwidth()
              + 2 * (t - 1) * hw.interconnect_latency_s)


def layer_allreduce_bytes(m: ModelSpec, tokens, dtype: str = DEFAULT_DTYPE):
    """What one layer all-reduces for `tokens` tokens: the O projection's and the FFN's partial
    outputs, [tokens, hidden] each (plus OLMoE's q/k sums of squares, negligible)."""
    return _t(2.0 * np.asarray(tokens, float) * m.hidden_size * dtype_bytes(dtype))


def layer_allreduce_time(hw: HardwareSpec, m: ModelSpec, tokens, dtype: str = DEFAULT_DTYPE):
    """Seconds of one layer's two all-reduces for a micro-batch of `tokens` tokens."""
    half = layer_allreduce_bytes(m, tokens, dtype) / 2.0
    return _t(2.0 * np.asarray(allreduce_time(hw, half), float))


def allreduce_link_bytes(hw: HardwareSpec, m: ModelSpec, tokens, dtype: str = DEFAULT_DTYPE):
    """Bytes one layer's all-reduces put on the host links, all GPUs together, per direction (zero
    over NVLink): over PCIe every GPU's ring traffic shares its lanes with the paged weights."""
    if not hw.has_gpu or not hw.interconnect_over_pcie:
        return _t(0.0 * np.asarray(tokens, float))
    return _t(hw.gpu_count * allreduce_bytes_per_gpu(hw, layer_allreduce_bytes(m, tokens, dtype)))


# ---- transfers ----
def transfer_time(hw: HardwareSpec, nbytes, direction: str = "h2d", copies=1, pinned: bool = True):
    """Seconds to move nbytes over the CPU<->GPU link (aggregate over GPUs) in `copies` copies:
    the link's fixed cost per copy plus bytes at its achieved pinned (or pageable) rate."""
    link = hw.link_total()
    if link is None:
        raise ValueError(f"hardware {hw.name!r} has no CPU<->GPU link")
    return _t(link.copy_seconds(nbytes, direction, copies, pinned))


def staging_time(hw: HardwareSpec, nbytes):
    """Seconds of the first paging hop: CPU memory -> pinned staging buffer, at the runtime's copy rate."""
    return _t(np.asarray(nbytes, float) / hw.staging_rate())


def h2d_time(hw: HardwareSpec, nbytes):
    return transfer_time(hw, nbytes, "h2d")


def d2h_time(hw: HardwareSpec, nbytes):
    return transfer_time(hw, nbytes, "d2h")


# ---- sizes ----
def qkv_bytes(m: ModelSpec, mu, dtype: str = DEFAULT_DTYPE):
    """Bytes of Q, K and V of mu tokens (what goes GPU -> CPU after pre-attention; MLA: the absorbed
    query and the new latent row)."""
    width = latent_attention.decode_widths(m)[0] if m.latent else m.q_dim + 2 * m.kv_dim
    return _t(np.asarray(mu, float) * width * dtype_bytes(dtype))


def attention_output_bytes(m: ModelSpec, mu, dtype: str = DEFAULT_DTYPE):
    """Bytes of the attention output of mu tokens (CPU -> GPU after CPU attention; MLA: in latent space)."""
    width = latent_attention.decode_widths(m)[1] if m.latent else m.q_dim
    return _t(np.asarray(mu, float) * width * dtype_bytes(dtype))


def hidden_bytes(m: ModelSpec, mu, dtype: str = DEFAULT_DTYPE):
    """Bytes of the hidden states of mu tokens."""
    return _t(np.asarray(mu, float) * m.hidden_size * dtype_bytes(dtype))


def layer_expert_bytes(m: ModelSpec, dtype: str = DEFAULT_DTYPE) -> float:
    """Bytes of one layer's expert weights (all E experts)."""
    return float(ops.layer_expert_bytes(m, dtype_bytes(dtype)))


def kv_cache_bytes(m: ModelSpec, seqs, context, dtype: str = DEFAULT_DTYPE, layers: int = 1, copies: int = 1):
    """Bytes of the KV cache of `seqs` sequences at `context` tokens, for `layers` layers (`copies`:
    kv_copies, the host copies tensor-parallel ranks keep)."""
    per = ops.kv_bytes_per_token_layer(m, dtype_bytes(dtype))
    return _t(np.asarray(seqs, float) * np.asarray(context, float) * per * layers * copies)


def kv_copies(hw: HardwareSpec, m: ModelSpec) -> int:
    """Host copies of the KV cache: one (tensor-parallel ranks split GQA's KV heads), or one per GPU for
    MLA, whose latent every rank keeps whole (moelight/parallel/__init__.py)."""
    return hw.gpu_count if m.latent and hw.has_gpu and hw.gpu_count > 1 else 1
