"""A vectorised, reproducible sampler: one generator per request.

Rows that ask for nothing but temperature / top-k / top-p take the original path (argmax for greedy
rows, one draw per sampled row); rows with penalties, biases, bans or a grammar get their logits
processed first (logits_processors.py), on a copy, so the raw logits stay the model's own for
logprobs. After temperature, `min_p` drops the tokens below min_p x the row's top probability.
"""

from __future__ import annotations

import torch

from cpu_kernels import topk_rows
from moelight.sampling.logits_processors import RowState, apply_processors
from moelight.sampling.params import SamplingParams

_NUCLEUS_CANDIDATES = 64  # top-p looks here first and sorts the whole row only if needed


class Sampler:
    """Draws one token per row; each request has its own generator, so its tokens do not
    depend on which other requests share its batch."""

    def __init__(self, params: list[SamplingParams], seeds: list[int]) -> None:
        self.params = params
        self.generators = [
            None if p.greedy else torch.Generator().manual_seed(p.seed if p.seed is not None else s)
            for p, s in zip(params, seeds, strict=False)
        ]

    def __call__(self, logits: torch.Tensor, rows: list[int], states: list[RowState] | None = None) -> torch.Tensor:
        """logits [B, V] float32 for requests `rows` (indices into params) -> tokens [B]. `states`: the
        rows' processor states, when any row has processors to apply (logits are then not modified)."""
        if states is not None and any(s.params.has_processors for s in states):
            logits = logits.clone()
            apply_processors(logits, states)
        tokens = topk_rows(logits.contiguous(), 1)[1][:, 0]  # argmax, one read of each row, rows in parallel
        sampled = [i for i, r in enumerate(rows) if not self.params[r].greedy]
        if not sampled:
            return tokens
        ps = [self.params[rows[i]] for i in sampled]
        x = logits[sampled] / torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
        if any(p.min_p > 0 for p in ps):
            x = _min_p(x, torch.tensor([p.min_p for p in ps], dtype=torch.float32))
        ks = torch.tensor([max(p.top_k, 0) for p in ps])
        if bool((ks > 0).any()):
            kmax = min(int(ks.max()), x.shape[-1])
            top_vals = topk_rows(x.contiguous(), kmax)[0]
            thresh = top_vals.gather(1, (ks.clamp(1, kmax) - 1)[:, None])
            thresh[ks == 0] = float("-inf")
            x = x.masked_fill(x < thresh, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        for j, p in enumerate(ps):
            if p.top_p < 1.0:
                probs[j] = _nucleus(probs[j], p.top_p)
        u = torch.stack([torch.rand(1, generator=self.generators[rows[i]]) for i in sampled])
        cdf = torch.cumsum(probs, dim=-1)
        # the first token whose cdf reaches the draw; a draw of exactly 0 (2^-24 of them) counts as the least
        # positive one, so it never picks a leading token of probability 0 (masked by top-k / top-p / min_p)
        draw = (u * cdf[:, -1:]).clamp_min(torch.finfo(cdf.dtype).tiny)
        choice = torch.searchsorted(cdf, draw).clamp(max=probs.shape[-1] - 1)
        tokens[sampled] = choice[:, 0]
        return tokens


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: after temperature, drop the tokens whose probability is below min_p x the top one."""
    probs = torch.softmax(x, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < floor, float("-inf"))


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p."""
    k = min(_NUCLEUS_CANDIDATES, probs.shape[-1])
    vals, idx = torch.topk(probs, k)
    if vals.sum() < top_p and k < probs.shape[-1]:
        vals, idx = torch.sort(probs, descending=True)
    cum = torch.cumsum(vals, 0)
    keep = (cum - vals) < top_p  # keep a token if the mass before it is below top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out
