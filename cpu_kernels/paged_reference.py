"""Pure-torch attention over a paged KV cache: the fallback, the path for sliding windows and sinks,
and the semantics the C++ kernels (csrc/paged_attention.cpp) must match.

A paged cache is the ragged layout's [Hkv, pages * page_size, d] tensor read through a block table:
position p of sequence b lives at slot ``table[b, p // page_size] * page_size + p % page_size``.
"""

from __future__ import annotations

import torch

from cpu_kernels.reference import _softmax_with_sinks


def paged_slots(table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of `positions` [N] of the sequences whose block-table rows are `table` [N, pages]."""
    page = table.gather(1, (positions // page_size)[:, None])[:, 0]
    return page * page_size + positions % page_size


def sequence_slots(table_row: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """Slots of positions [0, n) of one sequence."""
    pos = torch.arange(n, dtype=torch.int64, device=table_row.device)
    return table_row[pos // page_size] * page_size + pos % page_size


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, d]: the queries of sequence b at positions starts[b] .. starts[b] + n_b - 1 (rows
    cu_seqlens[b] .. cu_seqlens[b + 1]), each over the keys of every position up to its own, read
    through the block table -> [T, Hq, d]. Decode is the case n_b = 1 (starts = lengths - 1).
    `window`: a query sees itself and the window - 1 keys before it; `sinks` [Hq] as in decode."""
    T, Hq, d = q.shape
    Hkv = k_cache.shape[0]
    group = Hq // Hkv
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for b, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        n, start = e - s, int(starts[b])
        if n == 0:
            continue
        slots = sequence_slots(block_table[b], start + n, page_size)
        ks, vs = k_cache[:, slots].float(), v_cache[:, slots].float()  # [Hkv, L, d]
        qs = q[s:e].float().transpose(0, 1).reshape(Hkv, group, n, d)
        scores = torch.matmul(qs, ks.unsqueeze(1).transpose(-1, -2)) * scale  # [Hkv, g, n, L]
        qpos = torch.arange(start, start + n, device=q.device)[:, None]  # on q's device: the reference serves GPUs
        kpos = torch.arange(start + n, device=q.device)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        p = _softmax_with_sinks(scores.masked_fill(~visible, float("-inf")), sinks, Hkv, group)
        out[s:e] = torch.matmul(p, vs.unsqueeze(1)).reshape(Hq, n, d).transpose(0, 1).to(q.dtype)
    return out
