"""Attention on the device, next to a KV buffer there: batched over the sequences of a micro-batch
with every index on the device, so it issues a fixed number of kernels and no host sync.

Decode: each sequence's keys are gathered into [Hkv, B, max_len, d] (max_len known on the host:
positions are host data), scored against its query heads, masked past its length, softmaxed in
float32 (with GPT-OSS's sinks in the denominator), and the values weighted; a sliding window
narrows each sequence's block first. Prefill (with or without a cached prefix): varlen_attention,
the prompts grouped by length into a few padded calls, their bounds given on the host. Prefill
without a prefix on CPU tensors (the emulated device) runs the CPU engine's kernels instead, so the
emulated runtime keeps the CPU engine's low-precision numbers; tests hold the two paths together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpu_kernels import prefill_attention
from cpu_kernels.varlen_attention import SCORE_BUDGET, varlen_attention
from hrm.attention_memory import attention_score_budget
from moelight.devices.device_base import Device

Upload = Callable[[torch.Tensor], torch.Tensor] | None
GPU_PATH_ON_CPU = False  # tests: CPU tensors (the emulated device) take the GPU's prefill path, fused kernel too


def batched_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, offsets: torch.Tensor,
                             lengths: torch.Tensor, max_len: int, scale: float, window: int | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, d] over the ragged cache: keys [Hkv, T, d], values [Hkv, T, dv] (MLA's latent: the
    keys' first dv columns; offsets / lengths [B] on q's device, or a paged cache's slot table
    [B, >= max_len] for offsets; max_len >= every length, a host int) -> [B, Hq, dv] in q's dtype."""
    B, Hq, d = q.shape
    dv = v_cache.shape[-1]
    Hkv = k_cache.shape[0]
    g = Hq // Hkv
    skip = None
    if window is not None:
        skip = (lengths - window).clamp(min=0)
        lengths = lengths - skip
        max_len = min(max_len, window)
    span = torch.arange(max_len, device=q.device)
    valid = span[None, :] < lengths[:, None]  # [B, M]
    at = span[None, :] if skip is None else skip[:, None] + span[None, :]  # positions read
    if offsets.dim() == 2:  # a paged cache's slot table [B, >= every length]
        slots = offsets.gather(1, at.clamp(max=offsets.shape[1] - 1).expand(B, max_len))
    else:
        slots = offsets[:, None] + at
    idx = torch.where(valid, slots, 0).reshape(-1)
    k = k_cache.index_select(1, idx).view(Hkv, B, max_len, d).float()
    v = v_cache.index_select(1, idx).view(Hkv, B, max_len, dv).float()
    qh = q.float().view(B, Hkv, g, d).transpose(0, 1)  # [Hkv, B, g, d]
    s = torch.matmul(qh, k.transpose(-1, -2)) * scale  # [Hkv, B, g, M]
    s = s.masked_fill(~valid[None, :, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(Hkv, 1, g, 1).expand(Hkv, B, g, 1)
        both = torch.cat([s, sink], dim=-1)
        p = torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v)  # [Hkv, B, g, dv]
    return out.transpose(0, 1).reshape(B, Hq, dv).to(q.dtype)


def device_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_host: torch.Tensor, scale: float,
                             window: int | None = None, sinks: torch.Tensor | None = None,
                             upload: Upload = None, budget: int = SCORE_BUDGET) -> torch.Tensor:
    """Causal attention over packed prompts q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, dv] on the device: the
    prompts' bounds `cu_host` stay host data, and `upload` moves the groups' small tables (pinned).
    `budget`: elements one group call holds (score_budget: the device's share for them)."""
    if q.device.type == "cpu" and not GPU_PATH_ON_CPU:
        return prefill_attention(q, k, v, cu_host, scale, window=window, sinks=sinks, budget=budget)
    n = len(cu_host) - 1
    return varlen_attention(q, k.transpose(0, 1), v.transpose(0, 1), [0] * n, cu_host, scale, bases=cu_host[:-1],
                            window=window, sinks=sinks, upload=upload, fused=sinks is None, budget=budget)


def score_budget(device: Device) -> int:
    """Elements a prefill attention call may hold on `device`: a share of its memory, as the planner
    counts it (hrm.attention_memory), so a small GPU runs smaller groups instead of running out."""
    return attention_score_budget(device.memory_capacity)


def prefix_table(cached: list[int], seq_lens: list[int]) -> torch.Tensor:
    """Where device_prefix_prefill_attention finds each position of each sequence in its keys [prefixes of
    every sequence, then the packed new tokens]: int64 [B, longest] (host data, to upload pinned)."""
    total_prefix, rows, pre, new = sum(cached), [], 0, 0
    for c, n in zip(cached, seq_lens, strict=True):
        rows.append(list(range(pre, pre + c)) + list(range(total_prefix + new, total_prefix + new + n)))
        pre, new = pre + c, new + n
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)


def device_prefix_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_prefix: torch.Tensor,
                                    v_prefix: torch.Tensor, table: torch.Tensor, cached: torch.Tensor,
                                    cu_host: torch.Tensor, scale: float, window: int | None = None,
                                    sinks: torch.Tensor | None = None, upload: Upload = None,
                                    budget: int = SCORE_BUDGET) -> torch.Tensor:
    """Prompts whose first `cached` [B] (host data) positions are in a shared KV cache already (prefix
    sharing): the new tokens' q [T, Hq, d] over the uploaded prefixes' keys [Hkv, P, d] and their own k/v
    [T, Hkv, d], causal from their positions, through `table` (prefix_table, on the device)."""
    keys = torch.cat([k_prefix, k.transpose(0, 1)], 1)
    values = torch.cat([v_prefix, v.transpose(0, 1)], 1)
    return varlen_attention(q, keys, values, cached, cu_host, scale, block_table=table, window=window, sinks=sinks,
                            upload=upload, budget=budget)
