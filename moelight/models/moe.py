"""Mixture-of-Experts FFN: top-k routing and the expert matmuls (one per expert, or grouped GEMMs
over a runtime's stacked experts: grouped_experts.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpu_kernels import dispatch
from moelight.models.grouped_experts import GroupedExperts, grouped_expert_mix, swiglu, use_grouped_path


def few_bf16_rows(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """A bf16 decode step's few rows on the CPU, which small_linear takes."""
    return (x.dtype == gate_weight.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= dispatch.SMALL_LINEAR_ROWS
            and x.device.type == "cpu" and gate_weight.is_contiguous() and not torch.is_grad_enabled()
            and dispatch.small_linear_available())


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """x @ gate_weight^T in x's dtype. A bf16 decode step's few rows go to small_linear (one read of the
    weight, float32 sums): F.linear sends a 1-row bf16 matmul through oneDNN, ~30 us alone and ~200 us a
    call inside a decode step on the AMX host (8 a step on bench-1b)."""
    if few_bf16_rows(x, gate_weight):
        return dispatch.small_linear(x, gate_weight)
    return F.linear(x, gate_weight)


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, normalize: bool = True):
    """Softmax over all experts in float32, keep top-k, renormalise them to sum 1 (Mixtral, DBRX,
    Qwen with norm_topk_prob) or not (OLMoE, Qwen without it). A decode step's few bf16 rows: the same
    steps in one op call (csrc/route.cpp)."""
    if few_bf16_rows(x, gate_weight):
        return dispatch.route_topk(x, gate_weight, top_k, normalize)
    probs = torch.softmax(router_logits(x, gate_weight).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_output(x_rows: torch.Tensor, pair_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  linear=F.linear, activation=swiglu, gate_up_bias: torch.Tensor | None = None,
                  down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert over its rows, weighted by the rows' routing weights: scaled in float32 and rounded
    once to x's dtype, as the reference does (a runtime that runs an expert elsewhere, on the CPU
    next to its host copy, computes exactly this)."""
    gu = linear(x_rows, gate_up)
    if gate_up_bias is not None:
        gu = gu + gate_up_bias
    y = linear(activation(gu), down)
    if down_bias is not None:
        y = y + down_bias
    return (y * pair_weight).to(x_rows.dtype)


def expert_mix(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up_proj,
    down_proj,
    linear=F.linear,
    activation=swiglu,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    compute_order: list[int] | None = None,
    counts: list[int] | None = None,
    ready: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """x [T, h], routing weights / expert ids [T, k] -> sum of the weighted expert outputs [T, h].

    Token-expert pairs are sorted by expert so each expert runs one matmul over all its
    tokens. `gate_up_proj[e]` / `down_proj[e]` may be any indexable (a page table of
    device buffers, pre-packed CPU weights) that `linear(x, w)` accepts: only the experts
    that received tokens are touched. Experts are summed in ascending order, as the
    reference implementations do, so float32 results match them bit for bit in practice;
    `compute_order` runs them in another order (an expert cache's: the cached ones first) and
    still sums them in ascending order. `counts` (tokens per expert) are given where the caller has
    the routing on the host already (no read-back of the device's); a `GroupedExperts` table runs
    the grouped kernels instead, with no host sync at all; experts packed for the fused CPU kernel
    (runtime/fused_experts.py) run all at once there. `ready` holds experts' (token rows, weighted
    output) computed elsewhere (`expert_output` on the CPU): they are summed in their place.
    """
    if compute_order is None and hasattr(gate_up_proj, "fused_mix"):
        return gate_up_proj.fused_mix(x, weights, experts)
    if compute_order is None and counts is None and use_grouped_path(x, gate_up_proj):
        return grouped_expert_mix(x, weights, experts, gate_up_proj, activation, gate_up_bias, down_bias)
    if isinstance(down_proj, GroupedExperts):
        down_proj = down_proj.down_side
    top_k = experts.shape[-1]
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    token_of_pair = order // top_k
    pair_weight = weights.reshape(-1, 1).index_select(0, order)
    if counts is None:
        counts = torch.bincount(flat_experts, minlength=len(gate_up_proj)).tolist()
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    out = torch.zeros_like(x)

    def one(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = token_of_pair[starts[e] : starts[e + 1]]
        return rows, expert_output(x.index_select(0, rows), pair_weight[starts[e] : starts[e + 1]], gate_up_proj[e],
                                   down_proj[e], linear, activation,
                                   None if gate_up_bias is None else gate_up_bias[e],
                                   None if down_bias is None else down_bias[e])

    if compute_order is None:
        for e, n in enumerate(counts):
            if n:
                out.index_add_(0, *one(e))
        return out
    ready = ready or {}
    done = {e: ready[e] if e in ready else one(e) for e in compute_order if counts[e]}
    for e in sorted(done):
        out.index_add_(0, *done[e])
    return out
