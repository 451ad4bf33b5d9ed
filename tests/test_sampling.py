"""The sampler on hand-made logits: top-k / top-p semantics, temperature, seeds, bad params."""

from __future__ import annotations

import math

import pytest
import torch

from moelight.sampling.params import SamplingParams
from moelight.sampling.sampler import Sampler

DRAWS = 4000


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """n independent draws: n rows of the same logits, each with its own generator."""
    sampler = Sampler([params] * n, [seed + i for i in range(n)])
    return sampler(logits_row.repeat(n, 1), list(range(n)))


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs], dtype=torch.float32)


def freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g)
    params = [SamplingParams(temperature=0.0)] * 64
    assert params[0].greedy
    out = Sampler(params, list(range(64)))(logits, list(range(64)))
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    logits = torch.zeros(4, 10)
    logits[:, 3] = 1.0  # argmax 3, but a temperature-1 sample often picks something else
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)] * 2
    s = Sampler(params, [0, 1, 2, 3])
    greedy_rows, sampled_rows = [], []
    for _ in range(50):
        out = s(logits, [0, 1, 2, 3]).tolist()
        greedy_rows += [out[0], out[2]]
        sampled_rows += [out[1], out[3]]
    assert set(greedy_rows) == {3}
    assert len(set(sampled_rows)) > 3


def test_temperature_one_matches_softmax():
    probs = [0.4, 0.3, 0.2, 0.1]
    f = freqs(draw(logits_from_probs(probs), SamplingParams(temperature=1.0)), 4)
    assert torch.allclose(f, torch.tensor(probs, dtype=torch.float64), atol=0.03), f


def test_temperature_scales_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for t in (0.5, 2.0):
        f = freqs(draw(logits, SamplingParams(temperature=t)), 4)
        expect = torch.softmax(logits.double() / t, 0)
        assert torch.allclose(f, expect, atol=0.03), (t, f, expect)


def test_tiny_temperature_is_nearly_argmax():
    logits = torch.tensor([0.0, 0.5, 0.2, 0.49])
    assert set(draw(logits, SamplingParams(temperature=1e-3), n=500).tolist()) == {1}


def test_temperatures_below_vllms_epsilon_are_greedy():
    """Dividing by 1e-38 overflows every logit to inf (and the draw to NaN's last token): vLLM samples
    greedily below 1e-5, and so does moelight."""
    logits = torch.tensor([[30.0, 80.0, 20.0, 79.0]])
    for t in (1e-38, 1e-20, 9e-6):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and Sampler([p], [0])(logits, [0]).tolist() == [1]
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_draw_of_exactly_zero_never_picks_a_masked_token(monkeypatch):
    """torch.rand returns exactly 0 once in 2^24 draws: the first token of positive probability is taken,
    not token 0 that top-k / top-p masked out."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(*a, dtype=torch.float32))
    logits = torch.tensor([[0.0, 0.1, 3.0, 2.9]])
    for p in (SamplingParams(temperature=1.0, top_k=2, seed=1), SamplingParams(temperature=1.0, top_p=0.5, seed=1),
              SamplingParams(temperature=1.0, min_p=0.5, seed=1)):
        assert Sampler([p], [0])(logits, [0]).tolist() in ([2], [3]), p


@pytest.mark.parametrize("k", [1, 2, 5])
def test_top_k_only_draws_the_k_best(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(50, generator=g)
    allowed = set(torch.topk(logits, k).indices.tolist())
    # high temperature flattens the distribution so disallowed tokens would show up
    out = draw(logits, SamplingParams(temperature=5.0, top_k=k))
    assert set(out.tolist()) == allowed


def test_top_k_renormalises_over_the_kept_tokens():
    probs = [0.4, 0.3, 0.2, 0.1]
    f = freqs(draw(logits_from_probs(probs), SamplingParams(temperature=1.0, top_k=2)), 4)
    assert torch.allclose(f, torch.tensor([4 / 7, 3 / 7, 0, 0], dtype=torch.float64), atol=0.03), f


@pytest.mark.parametrize("k", [0, -1])
def test_top_k_disabled(k):
    probs = [0.25] * 4
    out = draw(logits_from_probs(probs), SamplingParams(temperature=1.0, top_k=k), n=400)
    assert set(out.tolist()) == {0, 1, 2, 3}


def test_top_k_larger_than_vocab_keeps_everything():
    out = draw(torch.zeros(5), SamplingParams(temperature=1.0, top_k=50), n=400)
    assert set(out.tolist()) == set(range(5))


@pytest.mark.parametrize(
    "top_p,allowed",
    [
        (0.45, {0}),  # 0.5 alone reaches 0.45
        (0.55, {0, 1}),  # 0.5 < 0.55: the next token is needed
        (0.75, {0, 1}),  # 0.5 + 0.3 = 0.8 >= 0.75
        (0.85, {0, 1, 2}),  # 0.8 < 0.85
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_nucleus_boundary(top_p, allowed):
    # shuffled order: the nucleus is by probability, not by token id
    probs = [0.15, 0.5, 0.05, 0.3]
    order = [1, 3, 0, 2]  # token ids by descending probability
    want = {order[i] for i in allowed}
    out = draw(logits_from_probs(probs), SamplingParams(temperature=1.0, top_p=top_p))
    assert set(out.tolist()) == want


def test_top_p_renormalises_over_the_nucleus():
    probs = [0.5, 0.3, 0.15, 0.05]
    f = freqs(draw(logits_from_probs(probs), SamplingParams(temperature=1.0, top_p=0.85)), 4)
    assert torch.allclose(f, torch.tensor([0.5, 0.3, 0.15, 0], dtype=torch.float64) / 0.95, atol=0.03), f


def test_top_p_with_a_wide_nucleus():
    """More than 64 tokens in the nucleus (the sampler's first look): the tail must still be drawn."""
    vocab = 300
    logits = torch.linspace(0.0, -3.0, vocab)  # distinct, slowly decaying
    probs = torch.softmax(logits.double(), 0)
    top_p = 0.9
    cum = torch.cumsum(probs, 0)
    n_keep = int(((cum - probs) < top_p).sum())
    assert n_keep > 64
    out = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), n=6000)
    drawn = set(out.tolist())
    assert max(drawn) < n_keep  # never past the nucleus
    assert max(drawn) >= 64  # ...but past the first 64 candidates


def test_top_k_and_top_p_together():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(200, generator=g) * 2
    k, top_p = 20, 0.9
    kept = torch.topk(logits, k)
    p = torch.softmax(kept.values.double(), 0)  # top-k first, then top-p on the renormalised rest
    cum = torch.cumsum(p, 0)
    allowed = set(kept.indices[(cum - p) < top_p].tolist())
    assert len(allowed) < k
    out = draw(logits, SamplingParams(temperature=1.0, top_k=k, top_p=top_p), n=6000)
    assert set(out.tolist()) <= allowed
    assert len(set(out.tolist())) >= len(allowed) - 2  # rare tail tokens may go undrawn


def test_seed_reproducible_and_seed_sensitive():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 100, generator=g)
    params = [SamplingParams(temperature=1.0, seed=42)] * 8

    def seq(sampler):
        return [sampler(logits, list(range(8))).tolist() for _ in range(20)]

    a = seq(Sampler(params, [0] * 8))
    b = seq(Sampler(params, [9] * 8))  # SamplingParams.seed wins over the default seeds
    assert a == b
    c = seq(Sampler([SamplingParams(temperature=1.0, seed=43)] * 8, [0] * 8))
    assert a != c
    # unset seed: the default seed passed to the Sampler decides
    d1 = seq(Sampler([SamplingParams(temperature=1.0)] * 8, list(range(8))))
    d2 = seq(Sampler([SamplingParams(temperature=1.0)] * 8, list(range(8))))
    d3 = seq(Sampler([SamplingParams(temperature=1.0)] * 8, list(range(1, 9))))
    assert d1 == d2 and d1 != d3


def test_row_draws_do_not_depend_on_other_rows():
    """A request's draws come from its own generator: sampling it alone or with others is the same."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    params = [SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=s) for s in (1, 2, 3)]
    both = Sampler(params, [0, 0, 0])
    alone = Sampler(params, [0, 0, 0])
    together = [both(logits, [0, 1, 2]).tolist() for _ in range(10)]
    only_row1 = [alone(logits[1:2], [1]).tolist()[0] for _ in range(10)]
    assert [t[1] for t in together] == only_row1


@pytest.mark.parametrize(
    "kwargs,word",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_invalid_params_raise(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
