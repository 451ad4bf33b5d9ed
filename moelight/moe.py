"""Mixture-of-Experts FFN: top-k routing and grouped expert matmuls (one per expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool = True):
    """Softmax over all experts in float32, keep top-k, renormalise them to sum 1 (Mixtral, DBRX,
    Qwen with norm_topk_prob) or not (OLMoE, Qwen without it)."""
    probs = torch.softmax(F.linear(x, gate_weight).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def moe_ffn(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_up_proj,
    down_proj,
    top_k: int,
    linear=F.linear,
    normalize: bool = True,
) -> torch.Tensor:
    """x [T, h] -> [T, h].

    Token-expert pairs are sorted by expert so each expert runs one matmul over all its
    tokens. `gate_up_proj[e]` / `down_proj[e]` may be any indexable (a page table of
    device buffers, pre-packed CPU weights) that `linear(x, w)` accepts: only the experts
    that received tokens are touched. Experts are summed in ascending order, as the
    reference implementation does, so float32 results match it bit for bit in practice.
    """
    weights, experts = route(x, gate_weight, top_k, normalize)
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    pair_weight = weights.reshape(-1, 1).index_select(0, order)
    counts = torch.bincount(flat_experts, minlength=gate_weight.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of_pair[start : start + n]
        gate, up = linear(x.index_select(0, rows), gate_up_proj[e]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, down_proj[e])
        # scale in float32, round once, as the reference does
        out.index_add_(0, rows, (y * pair_weight[start : start + n]).to(x.dtype))
        start += n
    return out
