"""FLOPs and bytes of the operators of one MoE decoder layer (DESIGN.md section 3).

Every function takes token / sequence counts that may be numpy arrays, so the
optimizer can evaluate a whole (micro-batch) grid at once. `b` is bytes per element.
Bytes count the weights read plus activations read and written; the KV cache
counts as the bytes attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hrm import latent_attention as mla
from hrm.model import ModelSpec

EXPERT_CHUNK_TOKENS = 2048  # tokens whose routed rows a layer pass holds at once (grouped experts)


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes touched of one operator (scalars or numpy arrays).

    rows: the M of the operator's GEMMs (tokens per weight matrix) when it is one; a
    measured level runs a GEMM at its FLOP/s for that M (Level.gemm_peak).
    """

    flops: object
    bytes: object
    rows: object = None

    @property
    def intensity(self):
        """Operational intensity, FLOPs per byte."""
        return np.asarray(self.flops, dtype=float) / np.asarray(self.bytes, dtype=float)

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.flops + other.flops, self.bytes + other.bytes)


def experts_touched(m: ModelSpec, tokens):
    """Expected distinct experts used by `tokens` tokens with uniform top-k routing: E(1-(1-k/E)^t)."""
    e, k = m.num_experts, m.top_k
    return e * (1.0 - np.power(1.0 - k / e, np.asarray(tokens, dtype=float)))


def qkv_proj(m: ModelSpec, tokens, b: float, prefill: bool = False) -> OpCost:
    """Input RMSNorm + QKV projection of `tokens` tokens (rotary is negligible and folded in); MLA's
    projections with decode's absorption or prefill's expansion (hrm/latent_attention.py)."""
    t = np.asarray(tokens, dtype=float)
    if m.latent:
        return OpCost(*mla.projections(m, t, b, prefill), t)
    h, out = m.hidden_size, m.q_dim + 2 * m.kv_dim
    flops = 2.0 * t * h * out + 4.0 * t * h
    byts = (h * out + h) * b + t * (h + out) * b
    return OpCost(flops, byts, t)


def o_proj(m: ModelSpec, tokens, b: float, prefill: bool = False) -> OpCost:
    """Attention output projection (H_q*d -> h) plus the residual add (MLA's decode: W_UV first)."""
    t = np.asarray(tokens, dtype=float)
    if m.latent:
        return OpCost(*mla.output(m, t, b, prefill), t)
    h, q = m.hidden_size, m.q_dim
    return OpCost(2.0 * t * q * h + t * h, q * h * b + t * (q + 2 * h) * b, t)


def router(m: ModelSpec, tokens, b: float) -> OpCost:
    """Post-attention RMSNorm + router logits (h -> E)."""
    h, e = m.hidden_size, m.num_experts
    t = np.asarray(tokens, dtype=float)
    return OpCost(2.0 * t * h * e + 4.0 * t * h, (h * e + h) * b + t * (2 * h + e) * b, t)


def expert_ffn(m: ModelSpec, tokens, b: float) -> OpCost:
    """One expert (w1, w3, w2) on `tokens` tokens: 6*h*f*t FLOPs, 3*h*f*b weight bytes."""
    h, f = m.hidden_size, m.intermediate_size
    t = np.asarray(tokens, dtype=float)
    return OpCost(6.0 * h * f * t, 3.0 * h * f * m.expert_weight_bytes(b) + 2.0 * t * h * b, t)


def moe_ffn(m: ModelSpec, tokens, b: float) -> OpCost:
    """The FFN of the average layer on `tokens` tokens. In a sparse layer: k expert-token
    passes each and the weights of the touched experts, plus the shared expert (every token)
    and its sigmoid gate; in a dense layer: the dense MLP. Weighted by the share of each."""
    h, f = m.hidden_size, m.intermediate_size
    t = np.asarray(tokens, dtype=float)
    s, d = m.sparse_fraction, 1.0 - m.sparse_fraction
    touched = experts_touched(m, t)
    routed_flops, routed_bytes = 6.0 * h * f * m.top_k * t, touched * 3.0 * h * f * m.expert_weight_bytes(b)
    fs, fd = m.shared_expert_size, m.dense_intermediate_size
    shared_flops = (6.0 * h * fs + 2.0 * h) * t if fs else 0.0 * t
    shared_bytes = (3.0 * h * fs + h) * b if fs else 0.0
    flops = s * (routed_flops + shared_flops) + d * 6.0 * h * fd * t
    byts = s * (routed_bytes + shared_bytes) + d * 3.0 * h * fd * b + 2.0 * t * h * b
    rows = m.top_k * t / np.maximum(touched, 1e-12)  # tokens per touched expert
    return OpCost(flops, byts, rows)


def decode_attention(m: ModelSpec, seqs, context, b: float) -> OpCost:
    """Decode attention (no projections) of `seqs` sequences at `context` tokens each.

    FLOPs 4*H_q*d*ctx per sequence (QK^T and PV); bytes: the K and V cache 2*H_kv*d*ctx*b
    plus the new q/k/v in and the output out. MLA: absorbed, every head over the latent rows.
    """
    if m.latent:
        return OpCost(*mla.decode_attention(m, seqs, context, b))
    s = np.asarray(seqs, dtype=float)
    c = m.attended_context(np.asarray(context, dtype=float))  # a sliding-window layer reads its window
    flops = 4.0 * m.q_dim * c * s
    byts = 2.0 * m.kv_dim * c * b * s + s * (2 * m.q_dim + 2 * m.kv_dim) * b
    return OpCost(flops, byts)


def prefill_attention(m: ModelSpec, seqs, prompt, b: float) -> OpCost:
    """Causal prefill attention (flash style, no score matrix in memory) of `seqs` prompts (MLA: expanded)."""
    if m.latent:
        return OpCost(*mla.prefill_attention(m, seqs, prompt, b))
    s, p = np.asarray(seqs, dtype=float), np.asarray(prompt, dtype=float)
    # 4*Hq*d*p*keys, keys per query p/2 under the causal mask (at most the window in a sliding layer)
    flops = 4.0 * m.q_dim * p * m.attended_context(p / 2.0) * s
    byts = s * p * (2 * m.q_dim + 2 * m.kv_dim) * b
    return OpCost(flops, byts)


def lm_head(m: ModelSpec, tokens, b: float) -> OpCost:
    """Final norm + lm_head (h -> V) of `tokens` tokens."""
    h, v = m.hidden_size, m.vocab_size
    t = np.asarray(tokens, dtype=float)
    return OpCost(2.0 * t * h * v + 4.0 * t * h, (v * h + h) * b + t * (h + v) * b, t)


# ---- element-wise work around the GEMMs (engine-specific, in eager torch) ----
def rmsnorm_bytes(elements, b: float):
    """Bytes one RMSNorm moves as the engine runs it: widen to float32, square, mean, scale,
    round back, times the weight (a float32 input skips the two casts)."""
    n = np.asarray(elements, dtype=float)
    casts = 2.0 * (b + 4.0) * n if b != 4 else 0.0
    return (20.0 + 2.0 * b) * n + casts


def pre_attention_elementwise(m: ModelSpec, tokens, b: float) -> OpCost:
    """Input RMSNorm and rotary on q and k (negate half, concatenate, two products, a sum:
    10 passes of b bytes) of `tokens` tokens. Memory-bound: no FLOPs counted."""
    t = np.asarray(tokens, dtype=float)
    if m.latent:  # RoPE on q_pe and the shared k_pe; RMSNorm on the latent (and the low-rank query) too
        rotated, normed = mla.rotary_and_norm_elements(m)
        return OpCost(0.0 * t, rmsnorm_bytes(t * (m.hidden_size + normed), b) + 10.0 * t * rotated * b)
    byts = rmsnorm_bytes(t * m.hidden_size, b) + 10.0 * t * (m.q_dim + m.kv_dim) * b
    return OpCost(0.0 * t, byts)


def post_attention_elementwise(m: ModelSpec, tokens, b: float) -> OpCost:
    """Post-attention RMSNorm, the MoE output buffer and final residual add (4 passes), and
    per token-expert pair: gather the input row (2h), SiLU and product on the intermediate
    (5f), scale by the routing weight in float32 and round back (2h*b + 8h), scatter-add (3h)."""
    h, f = m.hidden_size, m.intermediate_size
    t = np.asarray(tokens, dtype=float)
    pairs = m.sparse_fraction * m.top_k * t
    byts = rmsnorm_bytes(t * h, b) + 4.0 * t * h * b + pairs * ((7.0 * h + 5.0 * f) * b + 8.0 * h)
    # SiLU and product on a shared expert's or a dense MLP's intermediate, and the add / gate scaling
    dense_width = m.sparse_fraction * m.shared_expert_size + (1.0 - m.sparse_fraction) * m.dense_intermediate_size
    byts = byts + t * (5.0 * dense_width + (4.0 * h if m.shared_expert_size else 0.0)) * b
    return OpCost(0.0 * t, byts)


# ---- sizes in bytes ----
def kv_bytes_per_token_layer(m: ModelSpec, b: float) -> float:
    """K and V of one token in one layer (MLA: its latent and RoPE key)."""
    return float(mla.cache_width(m) * b) if m.latent else 2.0 * m.kv_dim * b


def layer_expert_bytes(m: ModelSpec, b: float) -> float:
    """One layer's routed experts as held (quantized: what a page moves over the link)."""
    return m.layer_expert_params() * m.expert_weight_bytes(b)


def expert_dequantize(m: ModelSpec, b: float) -> OpCost:
    """A GPU dequantizing one layer's quantized experts into the dtype before its GEMMs: every
    code and scale read, every weight written (a pure memory pass); nothing for 16-bit experts."""
    if not m.expert_bits:
        return OpCost(0.0, 0.0)
    params = m.layer_expert_params()
    return OpCost(2.0 * params, params * (m.expert_bits / 8.0 + b))


def activation_bytes_per_token(m: ModelSpec, b: float) -> float:
    """Peak live device bytes per token of a layer pass of at most EXPERT_CHUNK_TOKENS tokens, as the
    runtime computes it (measured on the emulated device: tests/test_activation_memory.py): the
    token's own tensors (activation_bytes_outside_experts) and its routed experts' rows
    (expert_activation_bytes_per_token)."""
    return activation_bytes_outside_experts(m, b) + expert_activation_bytes_per_token(m, b)


def activation_bytes_outside_experts(m: ModelSpec, b: float) -> float:
    """Hidden states, residual and norm, q/k/v and the attention output (MLA: in its larger form, the
    prefill's expanded heads), the shared expert, the router in float32: what a layer pass holds for
    every token it carries."""
    h = m.hidden_size
    attention = mla.activation_elements(m) if m.latent else 2 * m.q_dim + 2 * m.kv_dim
    return (3 * h + attention + 3 * m.shared_expert_size) * b + 4.0 * m.num_experts


def expert_activation_bytes_per_token(m: ModelSpec, b: float) -> float:
    """A token's routed rows in the grouped experts (models/grouped_experts.py: every token of a chunk
    at once), the larger of two phases: the GEMMs' (the rows in expert order, gate/up and the
    activation's temporaries, SwiGLU 4 widths and GPT-OSS's clamped one 8, a previous group's rows in
    float32) and the weighting's (rows in the dtype and in float32, back in token order)."""
    h, f, k = m.hidden_size, m.intermediate_size, m.top_k
    gemm = k * (h + (8 if m.expert_bias else 4) * f) * b + 4.0 * k * h
    return max(gemm, k * h * (4 * b + 4))


# host bytes a sampled row's logits hold per vocabulary entry at once on the CPU engine: the LM head's output
# in bf16 (2), its float32 copy (4), the sampler's float32 probabilities and their cumulative sums (8), a full
# sort of the row (float32 values, int64 indices: 12) where a nucleus reaches past the top candidates, and the
# sampler's other float32 passes (temperature, softmax); measured 35-38 at top-p 0.9 (what a decode step held
# more at 128 rows than at 64, vocabulary 151,936: benchmarks/kv_pool_memory.py, results/memory_planner_check.md)
LOGIT_ENTRY_BYTES = 40
# the same where every row is greedy (argmax, no processors, no logprobs): the LM head's output and its float32
# copy (the finite check and the argmax read them in place); measured 6 (the same benchmark, greedy)
ARGMAX_LOGIT_ENTRY_BYTES = 8


def sampled_logits_bytes(m: ModelSpec, rows, argmax_only: bool = False):
    """The logits of `rows` sequences sampled at once on the host, with the sampler's working copies (none
    where every row takes its argmax)."""
    return np.asarray(rows, float) * m.vocab_size * (ARGMAX_LOGIT_ENTRY_BYTES if argmax_only else LOGIT_ENTRY_BYTES)


def pass_activation_bytes(m: ModelSpec, b: float, tokens):
    """A layer pass of `tokens` tokens: every token's own tensors, and the routed rows of at most one
    chunk of EXPERT_CHUNK_TOKENS tokens (the runtime runs a longer pass's experts chunk by chunk)."""
    tokens = np.asarray(tokens, float)
    return (tokens * activation_bytes_outside_experts(m, b)
            + np.minimum(tokens, EXPERT_CHUNK_TOKENS) * expert_activation_bytes_per_token(m, b))


def host_run_activation_bytes(m: ModelSpec, b: float, pass_tokens, rows, argmax_only: bool = False):
    """What a job run all on the CPU holds beside its weights and KV pool at its largest: a layer pass of
    `pass_tokens` prompt tokens (a prefill pass; a decode step of `rows` rows where that is larger) and the
    logits of `rows` sequences sampled at once (`argmax_only`: WorkloadSpec.argmax_only). The planner's all-CPU
    placements and the memory check before loading (moelight/planning/memory_check.py) both count this. A
    Qwen3-shaped CPU engine held 384-488 MiB beside its pool in a ~4,096-token prefill pass (its rows' logits
    included) against 507 MiB counted for the pass alone; the count adds every row's logits to the largest pass,
    which never run together (a prefill pass samples its own rows only): 1.3-2.1x what was measured
    (benchmarks/results/memory_planner_check.md)."""
    rows = np.asarray(rows, float)
    tokens = np.maximum(np.asarray(pass_tokens, float), rows)
    return pass_activation_bytes(m, b, tokens) + sampled_logits_bytes(m, rows, argmax_only)
