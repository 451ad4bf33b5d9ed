"""DeepSeek's router: scores by softmax (V2) or sigmoid (V3), top-k limited to the best expert
groups, then renormalised (V3 with norm_topk_prob) and scaled by `routed_scaling_factor`.

The order of operations is transformers' (DeepseekV2TopkRouter, DeepseekV3TopkRouter), in float32,
so the same experts win and the weights match it bit for bit in practice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}


@dataclass(frozen=True)
class GroupRouting:
    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3: a selection-only score bias)
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0  # routed_scaling_factor

    @property
    def score_bias(self) -> bool:
        """V3's `e_score_correction_bias`: added to the scores for choosing experts, not to their weights."""
        return self.method == "noaux_tc"


class GroupRouter(nn.Module):
    """The router's weight (and V3's score bias), named as checkpoints name them (`mlp.gate.*`)."""

    def __init__(self, hidden: int, experts: int, top_k: int, routing: GroupRouting, normalize: bool) -> None:
        super().__init__()
        self.top_k, self.routing, self.normalize = top_k, routing, normalize
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        if routing.score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights (float32) and expert ids [T, k] of x [T, h]."""
        r, e = self.routing, self.weight.shape[0]
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32) if r.scoring == "softmax" else logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float() if r.score_bias else scores
        if r.method != "greedy":
            grouped = choice.view(-1, r.n_group, e // r.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if r.score_bias else grouped.max(dim=-1).values
            group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand(-1, r.n_group, e // r.n_group).reshape(-1, e).bool()
            choice = choice.masked_fill(~keep, float("-inf") if r.score_bias else 0.0)
        if r.score_bias:
            experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, experts)
        else:
            weights, experts = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * r.scaling, experts
