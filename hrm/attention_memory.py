"""Device memory of attention's temporaries, beside the KV cache and the layer pass's activations.

Prefill attention on a device runs as padded group calls (cpu_kernels/varlen_attention.py): each call
holds its scores, mask and gathered keys and values, at most a score budget of elements at once. The
budget is a share of the device's memory (`attention_score_budget`), so a small GPU cuts its groups
smaller instead of running out, and the planner counts what a pass's largest group holds.
"""

from __future__ import annotations

import numpy as np

from hrm import latent_attention as mla
from hrm.model import ModelSpec

SCORE_BUDGET = 1 << 24  # elements one padded attention call holds at most (varlen_attention's group_cost)
SCORE_SHARE = 16  # a device gives one attention call's temporaries at most 1/16 of its memory
MIN_SCORE_BUDGET = 1 << 12  # a call never holds less than one query row over its keys anyway
# Device bytes a call holds per group_cost element, the most measured on the strict emulated device
# (tests/test_attention_memory.py) over budgets of 2^16 .. 2^24: at the default budget the explicit
# float32 path (attention sinks) holds the scores and their masked and softmaxed copies (13 B), the fused
# path float32 copies of the rows' keys and values and the mask (4-7 B); small groups add the queries
# and outputs of their few rows (up to 23 B).
SCORE_ELEMENT_BYTES = 24.0


def attention_score_budget(capacity_bytes: float) -> int:
    """Elements one attention call may hold on a device of `capacity_bytes`: the kernels' default on a
    real GPU (16 GB: 1/16 is 1 GB), fewer on a small one."""
    return int(max(MIN_SCORE_BUDGET, min(SCORE_BUDGET, capacity_bytes / SCORE_SHARE / SCORE_ELEMENT_BYTES)))


def _key_width(m: ModelSpec) -> int:
    """Elements of K and V per key position as a call gathers them (MLA: expanded per head)."""
    if m.latent:
        return 2 * m.num_heads * max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    return 2 * m.num_kv_heads * m.head_dim


def call_elements(m: ModelSpec, seqs, prompt, budget: float):
    """group_cost of a prefill pass's largest call: every prompt's scores padded to the square (rows x
    keys per head) and its keys, within the budget, but never less than one query row over a prompt."""
    s, p = np.asarray(seqs, float), np.maximum(np.asarray(prompt, float), 1.0)
    need = s * p * (m.num_heads * p + _key_width(m))
    return np.maximum(np.minimum(need, budget), p * (m.num_heads + _key_width(m)))


def prefill_attention_scratch_bytes(m: ModelSpec, seqs, prompt, capacity_bytes: float):
    """Device bytes of a prefill pass's largest attention call, `seqs` prompts of `prompt` tokens."""
    return call_elements(m, seqs, prompt, attention_score_budget(capacity_bytes)) * SCORE_ELEMENT_BYTES


def decode_attention_scratch_bytes(m: ModelSpec, b: float, seqs, context):
    """A decode step's device attention temporaries (devices/device_attention.py): every sequence's keys and
    values gathered over the longest context in float32, one gathered in the dtype on its way, and the float32
    scores, masked and softmaxed (three of them). Grows with batch x context, beside the KV cache itself."""
    cached = mla.cache_width(m) if m.latent else 2.0 * m.kv_dim  # the elements a token holds in a layer
    per_position = cached * 4.0 + cached / 2 * b + 3 * 4.0 * m.num_heads
    return np.asarray(seqs, float) * context * per_position
