"""Attention over many sequences of different lengths in a few batched calls, not a loop per sequence:
the torch path on GPUs (prefill, prefixes read through block tables) and the CPU fallback where the
C++ kernels do not reach (head sizes they lack, sliding windows, sinks).

Each sequence's queries (rows ``cu[b] .. cu[b + 1]`` of the packed q, at positions ``starts[b] ..``) see
the keys at every position up to their own, read from a cache [Hkv, S, d] through a block table or
from a contiguous run of slots. The sequences are sorted by how many keys they see and cut into groups
whose padding stays small (padded scores at most twice the real ones) and whose scores fit a budget;
each group is one padded attention with a causal (and window) mask. The host plans the groups from
host ints; every index is then computed on q's device from one small table per group, uploaded once,
so a GPU caller issues a fixed number of kernels per group and never waits for the device.

Semantics are those of ``paged_reference.paged_attention_torch``; tests hold the two together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hrm.attention_memory import SCORE_BUDGET  # elements per group call: scores, mask, gathered K and V


@dataclass(frozen=True)
class Chunk:
    """Queries [q0, q1) of sequence `seq`, whose keys start at position `first_key`; `keys` of them."""

    seq: int
    q0: int
    q1: int
    first_key: int
    keys: int

    @property
    def rows(self) -> int:
        return self.q1 - self.q0


def plan_chunks(starts: list[int], counts: list[int], window: int | None, heads: int, kv_width: int,
                budget: int = SCORE_BUDGET) -> list[list[Chunk]]:
    """Groups of query chunks, each group one padded call costing `group_cost` elements. A sequence
    whose own cost exceeds the budget is cut into query chunks."""
    chunks = []
    for b, (s, n) in enumerate(zip(starts, counts, strict=True)):
        if n == 0:
            continue
        step = max(1, (budget // max(1, s + n) - kv_width) // heads)
        for q0 in range(0, n, step):
            q1 = min(n, q0 + step)
            first = max(0, s + q0 - window + 1) if window is not None else 0
            if s + q1 > first:  # a sequence with no keys (an empty slot of a batch) attends to nothing: zeros
                chunks.append(Chunk(b, q0, q1, first, s + q1 - first))
    chunks.sort(key=lambda c: (-c.keys, -c.rows))
    groups: list[list[Chunk]] = []
    rows = real = 0  # the open group's widest chunk and its real (row, key) cells
    for c in chunks:
        if groups:
            g = groups[-1]
            n, wide, cells, keys = len(g) + 1, max(rows, c.rows), real + c.rows * c.keys, g[0].keys
            if n * wide * keys <= 2 * cells and group_cost(n, wide, keys, heads, kv_width) <= budget:
                g.append(c)
                rows, real = wide, cells
                continue
        groups.append([c])
        rows, real = c.rows, c.rows * c.keys
    return groups


def group_cost(count: int, rows: int, keys: int, heads: int, kv_width: int) -> int:
    """Elements one padded call holds: scores and mask per head, row and key; the gathered keys and
    values (`kv_width`: 2 x Hkv x d) per key."""
    return count * keys * (heads * rows + kv_width)


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, starts: list[int] | torch.Tensor,
                     cu_seqlens: list[int] | torch.Tensor, scale: float, *, block_table: torch.Tensor | None = None,
                     page_size: int = 1, bases: list[int] | torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, upload: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     budget: int = SCORE_BUDGET, fused: bool | None = None) -> torch.Tensor:
    """q [T, Hq, d] packed by `cu_seqlens` (host data), sequence b's rows at positions starts[b] .. (host
    data), over keys [Hkv, S, d] / values [Hkv, S, dv] at slot ``table[b, p // page_size] * page_size +
    p % page_size`` (`block_table` on q's device) or ``bases[b] + p`` (host data) -> [T, Hq, dv] in q's
    dtype. `window`: a query sees itself and the window - 1 keys before it; `sinks` [Hq] (GPT-OSS): a
    logit per query head in every softmax's denominator. `upload` moves a small host int64 table to q's
    device (a pinned copy on GPUs); by default `.to(q.device)`. `fused`: scaled_dot_product_attention
    (in float32 on the CPU, in q's dtype on GPUs) instead of explicit float32 scores (default: where
    there are no sinks)."""
    T, Hq, d = q.shape
    Hkv, dv = k_cache.shape[0], v_cache.shape[-1]
    assert (block_table is None) != (bases is None), "give a block table or contiguous bases"
    if fused is None:
        fused = sinks is None
    assert not (fused and sinks is not None), "sinks need the explicit scores"
    compute = q.dtype if fused and q.device.type != "cpu" else torch.float32
    out = q.new_zeros(T + 1, Hq, dv)  # row T takes the padded rows' results
    up = upload or (lambda t: t.to(q.device))
    base_key = tuple(_ints(bases)) if bases is not None else None
    plan = _host_plan(tuple(_ints(starts)), tuple(_ints(cu_seqlens)), base_key, window, Hq, 2 * Hkv * max(d, dv),
                      budget)
    for meta, rows, keys in plan:
        res, dest = _group_attention(q, k_cache, v_cache, up(meta), rows, keys, scale, block_table, page_size,
                                     window, sinks, fused, compute, T)
        out.index_copy_(0, dest, res)
    return out[:T]


@functools.lru_cache(maxsize=16)
def _host_plan(starts: tuple[int, ...], cu: tuple[int, ...], bases: tuple[int, ...] | None, window: int | None,
               heads: int, kv_width: int, budget: int) -> list[tuple[torch.Tensor, int, int]]:
    """Each group's table [G, 6] (read-only), widest chunk and key count. Every layer of a pass asks for
    the same plan (sliding-window layers for another), so it is built once per pass, not per layer."""
    counts = [e - s for s, e in zip(cu[:-1], cu[1:], strict=True)]
    plan = []
    for group in plan_chunks(list(starts), counts, window, heads, kv_width, budget):
        meta = torch.tensor([[c.seq, starts[c.seq] + c.q0, c.rows, cu[c.seq] + c.q0, c.first_key,
                              bases[c.seq] if bases is not None else 0] for c in group], dtype=torch.int64)
        plan.append((meta, max(c.rows for c in group), group[0].keys))
    return plan


def _group_attention(q, k_cache, v_cache, meta, rows: int, keys: int, scale: float, block_table, page_size: int,
                     window, sinks, fused: bool, compute: torch.dtype, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One padded call: meta [G, 6] (sequence, first query position, query rows, first packed row,
    first key position, contiguous base) -> results [G * rows, Hq, dv] and their rows in the output
    (padding goes to row T)."""
    G, Hq, d = meta.shape[0], q.shape[1], q.shape[2]
    Hkv, dv = k_cache.shape[0], v_cache.shape[-1]
    g = Hq // Hkv
    seq, qpos0, nq, qrow0, kfirst, base = meta.unbind(1)
    i = torch.arange(rows, device=q.device)
    valid = i[None, :] < nq[:, None]  # [G, rows]
    qrows = qrow0[:, None] + torch.minimum(i[None, :], nq[:, None] - 1)
    qpos = qpos0[:, None] + i[None, :]
    kpos = kfirst[:, None] + torch.arange(keys, device=q.device)[None, :]  # [G, keys]
    # padding keys read the chunk's last key again: slots past a sequence may hold anything, NaN included,
    # and a masked NaN value still poisons the weighted sum
    kread = torch.minimum(kpos, (qpos0 + nq - 1)[:, None])
    if block_table is not None:
        pages = block_table.index_select(0, seq)
        slots = pages.gather(1, kread // page_size) * page_size + kread % page_size
    else:
        slots = base[:, None] + kread
    slots = slots.reshape(-1)
    k = k_cache.index_select(1, slots).view(Hkv, G, keys, d).transpose(0, 1).to(compute)
    v = v_cache.index_select(1, slots).view(Hkv, G, keys, dv).transpose(0, 1).to(compute)
    visible = kpos[:, None, :] <= qpos[:, :, None]  # [G, rows, keys]
    if window is not None:
        visible &= kpos[:, None, :] > qpos[:, :, None] - window
    # GQA folded into the rows: each key head serves its g query heads' rows, one mask tiled g times
    qg = q.index_select(0, qrows.reshape(-1)).view(G, rows, Hkv, g, d).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(G, Hkv, g * rows, d).to(compute)
    mask = visible[:, None].expand(G, g, rows, keys).reshape(G, 1, g * rows, keys)
    if fused:  # the device's attention kernel (memory-efficient: no score tensor)
        o = torch.nn.functional.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    else:  # explicit float32 scores, as the reference and the CPU engine's other paths compute them
        s = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [G, Hkv, g * rows, keys]
        s = s.masked_fill(~mask, float("-inf"))
        if sinks is not None:
            sink = sinks.to(s.dtype).view(1, Hkv, g, 1, 1).expand(G, Hkv, g, rows, 1).reshape(G, Hkv, g * rows, 1)
            s = torch.cat([s, sink], dim=-1)
        p = torch.softmax(s - s.amax(dim=-1, keepdim=True), dim=-1)
        o = torch.matmul(p[..., :keys], v)
    o = o.view(G, Hkv, g, rows, dv).permute(0, 3, 1, 2, 4).reshape(G * rows, Hq, dv).to(q.dtype)
    dest = torch.where(valid, qrow0[:, None] + i[None, :], T).reshape(-1)
    return o, dest


def _ints(x: list[int] | torch.Tensor) -> list[int]:
    """Host ints from a list or a host tensor (a device tensor here would cost a sync: refuse it)."""
    if isinstance(x, torch.Tensor):
        assert x.device.type == "cpu", "sequence bounds must be host data"
        return x.tolist()
    return list(x)
