"""Multi-head latent attention's FLOPs and bytes (DeepSeek-V2/V3, Kimi-K2): what operators.py counts
for a model whose `kv_lora_rank` is set, in the forms the engine runs. Decode is absorbed: W_UK folded
into the query and W_UV into the output, so attention is an MQA of every head over the cached rows
[latent, RoPE key]; prefill is expanded: per-head K and V from the latent, then ordinary attention.

Notation: t tokens, h hidden, H heads, r = kv_lora_rank, e = qk_rope_head_dim, n = qk_nope_head_dim,
v = v_head_dim, q = q_lora_rank (0: a plain q projection), b bytes per element. Functions return
(FLOPs, bytes); counts may be numpy arrays.
"""

from __future__ import annotations

import numpy as np

from hrm.model import ModelSpec


def _dims(m: ModelSpec):
    return (m.hidden_size, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim,
            m.q_lora_rank)


def projections(m: ModelSpec, tokens, b: float, prefill: bool):
    """Norm, q, kv_a and (decode) the absorption q_nope W_UK, or (prefill) the expansion of K and V."""
    h, heads, r, e, n, v, q = _dims(m)
    t = np.asarray(tokens, dtype=float)
    weights = m.latent_query_params() + h * (r + e) + r
    flops = 2.0 * t * (weights - q - r) + 4.0 * t * h
    if prefill:  # kv_b_proj over the latent: per-head K (nope part) and V
        weights, flops = weights + r * heads * (n + v), flops + 2.0 * t * r * heads * (n + v)
        out = heads * (n + e) + heads * (n + e) + heads * v + r + e
    else:  # W_UK: q_nope -> latent space, per head
        weights, flops = weights + heads * n * r, flops + 2.0 * t * heads * n * r
        out = heads * (r + e) + r + e
    return flops, weights * b + t * (h + out) * b


def output(m: ModelSpec, tokens, b: float, prefill: bool):
    """(Decode) W_UV back from latent space, then o_proj and the residual add."""
    h, heads, r, _, _, v, _ = _dims(m)
    t = np.asarray(tokens, dtype=float)
    weights, flops, width = heads * v * h, 2.0 * t * heads * v * h + t * h, heads * v
    if not prefill:
        weights, flops, width = weights + heads * v * r, flops + 2.0 * t * heads * r * v, heads * r
    return flops, weights * b + t * (width + 2 * h) * b


def decode_attention(m: ModelSpec, seqs, context, b: float):
    """Absorbed decode: every head scores the row (r + e) and sums the latent (r) of each cached key;
    bytes: the rows once (all heads share them), the absorbed queries in, the latent outputs out."""
    _, heads, r, e, _, _, _ = _dims(m)
    s, c = np.asarray(seqs, dtype=float), np.asarray(context, dtype=float)
    flops = 2.0 * heads * (2 * r + e) * c * s
    return flops, (r + e) * c * b * s + s * (heads * (r + e) + (r + e) + heads * r) * b


def prefill_attention(m: ModelSpec, seqs, prompt, b: float):
    """Expanded causal prefill: scores over n + e, values of v, each query over p / 2 keys. The CPU
    kernel runs V zero-padded to the key width (cpu_kernels.prefill_attention), so its values cost
    n + e too, and the padded V is written and read once more."""
    _, heads, _, e, n, v, _ = _dims(m)
    s, p = np.asarray(seqs, dtype=float), np.asarray(prompt, dtype=float)
    v_run = max(v, n + e)
    flops = 2.0 * heads * (n + e + v_run) * p * (p / 2.0) * s
    return flops, s * p * (2 * heads * (n + e) + 2 * heads * v + 2 * heads * v_run) * b


def cache_width(m: ModelSpec) -> int:
    """Elements a token keeps per layer: the latent and the RoPE key."""
    return m.kv_lora_rank + m.qk_rope_head_dim


def decode_widths(m: ModelSpec) -> tuple[int, int]:
    """Elements per token that cross to CPU attention (absorbed query and the new row) and back (latent)."""
    heads, w = m.num_heads, cache_width(m)
    return heads * w + w, heads * m.kv_lora_rank


def rotary_and_norm_elements(m: ModelSpec) -> tuple[int, int]:
    """(elements rotated: q_pe of every head and the shared k_pe; elements normed besides the hidden state:
    the latent and the low-rank query)."""
    return (m.num_heads + 1) * m.qk_rope_head_dim, m.kv_lora_rank + m.q_lora_rank


def activation_elements(m: ModelSpec) -> int:
    """q, k, v and attention output of a token, in the larger of the two forms (prefill expanded)."""
    heads, w = m.num_heads, cache_width(m)
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return max(2 * heads * qk + heads * m.v_head_dim + w + heads * m.v_head_dim,
               heads * w + w + heads * m.kv_lora_rank)
