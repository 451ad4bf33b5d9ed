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

_NUCLEUS_CANDIDATES = 64  # top-p looks here first...
_WIDE_CANDIDATES = 4096  # ...then here, and sorts the whole row only if the nucleus reaches past these


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
        nuc = [j for j, p in enumerate(ps) if p.top_p < 1.0]
        if nuc:
            top_p = torch.tensor([ps[j].top_p for j in nuc], dtype=torch.float32)
            if len(nuc) == len(ps):
                probs = _nucleus(probs, top_p)
            else:
                probs[nuc] = _nucleus(probs[nuc], top_p)
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


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero all but each row's smallest set of most likely tokens whose mass reaches its top_p (rows [N, V],
    top_p [N]), in one batched pass: per-row Python loops made top-p 5-13x slower than temperature. The
    kept set (ties included) is the one of a per-row top-64, else of a full descending sort, as before."""
    n, v = probs.shape
    k = min(_NUCLEUS_CANDIDATES, v)
    vals, idx = torch.topk(probs, k)
    keep = torch.zeros(probs.shape, dtype=torch.bool)
    wide = vals.sum(dim=-1) < top_p if k < v else torch.zeros(n, dtype=torch.bool)
    narrow = (~wide).nonzero()[:, 0]
    if len(narrow) == n:  # the common case: no row copies
        return probs.masked_fill(~keep.scatter_(1, idx, _mass_before(vals) < top_p[:, None]), 0.0)
    if len(narrow):
        keep[narrow] = keep[narrow].scatter(1, idx[narrow], _mass_before(vals[narrow]) < top_p[narrow, None])
    rows = wide.nonzero()[:, 0]
    if len(rows) == n:
        return probs.masked_fill(~_wide_keep(probs, top_p), 0.0)
    if len(rows):
        keep[rows] = _wide_keep(probs[rows], top_p[rows])
    return probs.masked_fill(~keep, 0.0)


def _mass_before(vals: torch.Tensor) -> torch.Tensor:
    """The mass before each token in its row's descending order: a token is kept while this is below top_p."""
    return torch.cumsum(vals, dim=-1) - vals


def _wide_keep(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus mask of rows whose top 64 hold less than top_p. A full sort costs ~2 ms a row; the top 4096
    decide a row unless its nucleus ends past them or splits equal values: only those rows are sorted whole."""
    n, v = probs.shape
    k = min(_WIDE_CANDIDATES, v)
    if k < v:
        vals, idx = torch.topk(probs, k)
        kept = _mass_before(vals) < top_p[:, None]
        last = kept.sum(dim=-1, keepdim=True) - 1  # the nucleus is a prefix of the order
        # decided: the nucleus ends inside the candidates, between two different values (the order of equal
        # values, which the sort leaves to its implementation, moves neither the sums nor the cut)
        done = ~kept[:, -1] & (vals.gather(1, last)[:, 0] > vals.gather(1, (last + 1).clamp(max=k - 1))[:, 0])
    else:
        done = torch.zeros(n, dtype=torch.bool)
    keep = torch.zeros(probs.shape, dtype=torch.bool)
    if bool(done.all()):  # the common case: no row copies
        return keep.scatter_(1, idx, kept)
    if bool(done.any()):
        keep[done] = keep[done].scatter(1, idx[done], kept[done])
    rest = (~done).nonzero()[:, 0]
    if len(rest):
        vals, idx = torch.sort(probs[rest], dim=-1, descending=True)
        keep[rest] = keep[rest].scatter(1, idx, _mass_before(vals) < top_p[rest, None])
    return keep
