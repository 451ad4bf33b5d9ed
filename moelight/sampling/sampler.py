"""A vectorised, reproducible sampler: one generator per request."""

from __future__ import annotations

import torch

from cpu_kernels import topk_rows
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

    def __call__(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [B, V] float32 for requests `rows` (indices into params) -> tokens [B]."""
        tokens = topk_rows(logits, 1)[1][:, 0]  # argmax, one read of each row, rows in parallel
        sampled = [i for i, r in enumerate(rows) if not self.params[r].greedy]
        if not sampled:
            return tokens
        ps = [self.params[rows[i]] for i in sampled]
        x = logits[sampled] / torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
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
        choice = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp(max=probs.shape[-1] - 1)
        tokens[sampled] = choice[:, 0]
        return tokens


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
