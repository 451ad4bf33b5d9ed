"""Rolling batches: freed KV slots are refilled with waiting requests (Engine(refill=True)).

The tokens must equal static batching's (per-request seeds), the pool must never hand
out overlapping regions, and refilling must cut the decode steps of a mixed workload.
"""

from __future__ import annotations

import random

import pytest
import torch

from moelight.engine.generation import Engine, GenerationStats
from moelight.engine.slot_pool import SlotPool
from moelight.loading.presets import preset_config
from moelight.loading.weights import build_model
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts

CFG = preset_config("tiny")
PROMPTS = random_prompts(23, CFG.vocab_size, min_len=2, max_len=40, seed=11)
# mixed answer lengths, as real EOS gives: short ones free their slots early
LENGTHS = [2 + (7 * k) % 19 for k in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, torch.float32, None, seed=5)


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=temperature, top_k=20, ignore_eos=True) for n in LENGTHS]


def _run(model, refill: bool, params, batch_size=8, micro=3, on_finish=None):
    stats = GenerationStats()
    eng = Engine(model, CFG.eos_token_ids, max_prefill_tokens=48, refill=refill)
    res = eng.generate(PROMPTS, params, list(range(len(PROMPTS))), batch_size, micro, on_finish=on_finish,
                       stats=stats)
    return [r.token_ids for r in res], stats


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_refill_gives_static_batching_tokens(model, temperature):
    static, s_stats = _run(model, False, _params(temperature))
    rolling, r_stats = _run(model, True, _params(temperature))
    assert rolling == static
    assert [len(t) for t in rolling] == LENGTHS
    assert r_stats.generated_tokens == s_stats.generated_tokens == sum(LENGTHS)
    assert r_stats.decode_tokens == s_stats.decode_tokens


def test_refill_cuts_decode_steps_and_reports_waves(model):
    _, s_stats = _run(model, False, _params(0.0))
    _, r_stats = _run(model, True, _params(0.0))
    steps = lambda st: sum(b["decode_steps"] for b in st.batches)  # noqa: E731
    assert steps(r_stats) < steps(s_stats)
    assert len(r_stats.batches) > len(s_stats.batches) == 3  # 23 requests in static batches of 8
    assert sum(b["sequences"] for b in r_stats.batches) == len(PROMPTS)
    assert all(b["micro_batches"] <= 3 for b in r_stats.batches)  # ceil(8 / 3)


def test_finished_sequences_are_reported_as_they_end(model):
    order = []
    _run(model, True, _params(0.0), on_finish=lambda r: order.append(r.index))
    assert sorted(order) == list(range(len(PROMPTS)))
    assert LENGTHS[order[0]] == min(LENGTHS[:8])  # the shortest answer of the first wave is out first
    assert order != sorted(order)  # reported as they end, not in request order


def test_refill_with_batch_of_one_and_batch_of_all(model):
    static, _ = _run(model, False, _params(0.0), batch_size=1, micro=1)
    assert _run(model, True, _params(0.0), batch_size=1, micro=1)[0] == static
    assert _run(model, True, _params(0.0), batch_size=64, micro=5)[0] == static


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_requests_that_end_at_their_first_token_do_not_strand_the_waiting_ones(model, batch_size):
    """A wave whose every sequence ends at prefill (max_tokens 1, a prompt cut to fit the context) leaves
    nothing to decode: the next wave must still be admitted."""
    params = [SamplingParams(max_tokens=1 if k < 4 or k % 3 else 4, temperature=0.0, ignore_eos=True)
              for k in range(len(PROMPTS))]
    static, _ = _run(model, False, params, batch_size=batch_size, micro=1)
    rolling, stats = _run(model, True, params, batch_size=batch_size, micro=1)
    assert len(rolling) == len(PROMPTS) and rolling == static
    assert stats.generated_tokens == sum(p.max_tokens for p in params)


def test_slot_pool_first_fit_and_merge():
    pool = SlotPool(10)
    a, b, c = pool.take(3), pool.take(4), pool.take(3)
    assert (a, b, c) == (0, 3, 7) and pool.take(1) is None and pool.free_slots == 0
    pool.give(b, 4)
    assert pool.take(5) is None and pool.take(2) == 3  # first fit inside the hole
    assert pool.give(a, 3) == 3 and pool.give(c, 3) == 5  # the size of the free region each joins
    assert pool.give(3, 2) == 10
    assert pool.free_slots == 10 and pool.take(10) == 0  # everything merged back into one region
    with pytest.raises(ValueError):
        pool.give(0, 11)
    with pytest.raises(ValueError):
        SlotPool(4).give(1, 2)  # never handed out


def test_slot_pool_random_regions_never_overlap():
    rng = random.Random(0)
    pool, used = SlotPool(200), {}
    for _ in range(2000):
        if used and rng.random() < 0.5:
            start = rng.choice(list(used))
            pool.give(start, used.pop(start))
        else:
            n = rng.randint(1, 30)
            start = pool.take(n)
            if start is not None:
                assert all(start + n <= s or s + m <= start for s, m in used.items())
                used[start] = n
        assert pool.free_slots == 200 - sum(used.values())
