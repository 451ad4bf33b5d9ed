"""The batched top-p keeps exactly the tokens of the per-row algorithm it replaced, so a seeded request
draws the same token as before; the old algorithm is kept here as the reference."""

from __future__ import annotations

import pytest
import torch

from moelight.sampling.params import SamplingParams
from moelight.sampling.sampler import Sampler, _nucleus


def old_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The per-row top-p before batching: the top 64, else a full descending sort."""
    k = min(64, probs.shape[-1])
    vals, idx = torch.topk(probs, k)
    if vals.sum() < top_p and k < probs.shape[-1]:
        vals, idx = torch.sort(probs, descending=True)
    cum = torch.cumsum(vals, 0)
    keep = (cum - vals) < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = vals[keep]
    return out


def old_sample(params: list[SamplingParams], seeds: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The old Sampler.__call__ (no processors): per-row nucleus, then one draw per sampled row."""
    gens = [None if p.greedy else torch.Generator().manual_seed(p.seed if p.seed is not None else s)
            for p, s in zip(params, seeds, strict=True)]
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens
    ps = [params[i] for i in sampled]
    x = logits[sampled] / torch.tensor([p.temperature for p in ps], dtype=torch.float32)[:, None]
    if any(p.min_p > 0 for p in ps):
        pr = torch.softmax(x, dim=-1)
        floor = torch.tensor([p.min_p for p in ps])[:, None] * pr.max(dim=-1, keepdim=True).values
        x = x.masked_fill(pr < floor, float("-inf"))
    ks = torch.tensor([max(p.top_k, 0) for p in ps])
    if bool((ks > 0).any()):
        kmax = min(int(ks.max()), x.shape[-1])
        thresh = torch.topk(x, kmax).values.gather(1, (ks.clamp(1, kmax) - 1)[:, None])
        thresh[ks == 0] = float("-inf")
        x = x.masked_fill(x < thresh, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    for j, p in enumerate(ps):
        if p.top_p < 1.0:
            probs[j] = old_nucleus(probs[j], p.top_p)
    u = torch.stack([torch.rand(1, generator=gens[i]) for i in sampled])
    cdf = torch.cumsum(probs, dim=-1)
    draw = (u * cdf[:, -1:]).clamp_min(torch.finfo(cdf.dtype).tiny)
    tokens[sampled] = torch.searchsorted(cdf, draw).clamp(max=probs.shape[-1] - 1)[:, 0]
    return tokens


def make_logits(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "flat":  # dummy weights: the nucleus is most of the vocabulary (a full sort)
        return x * 0.05
    if kind == "peaked":  # a nucleus of tens of tokens (the first 64)
        return x * 6
    if kind == "medium":  # a nucleus of ~1500 tokens (the wider candidates)
        return x * 3
    return (x * 3).round() / 2  # "ties": few distinct values, the nucleus ends inside a group of equal ones


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.7, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=50),
    SamplingParams(temperature=1.0, top_k=3000, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.99, min_p=0.01),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_p=0.3, seed=7),
]


@pytest.mark.parametrize("kind", ["flat", "peaked", "medium", "ties"])
@pytest.mark.parametrize("vocab", [32000, 200])
def test_batched_nucleus_keeps_the_old_tokens(kind, vocab):
    probs = torch.softmax(make_logits(kind, 12, vocab, seed=vocab), dim=-1)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.95, 0.999] * 2, dtype=torch.float32)
    want = torch.stack([old_nucleus(probs[i], float(top_p[i])) for i in range(len(probs))])
    assert torch.equal(_nucleus(probs.clone(), top_p), want)


@pytest.mark.parametrize("kind", ["flat", "peaked", "medium", "ties"])
def test_seeded_draws_are_the_old_ones_in_mixed_batches(kind):
    rows, vocab = 16, 32000
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    for seed in range(2):
        logits = make_logits(kind, rows, vocab, seed=100 + seed)
        seeds = [seed * 1000 + i for i in range(rows)]
        got = Sampler(params, seeds)(logits.clone(), list(range(rows)))
        assert torch.equal(got, old_sample(params, seeds, logits)), (kind, seed)
