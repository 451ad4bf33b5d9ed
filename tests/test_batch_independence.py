"""A sequence's output must not depend on what else shares its batch.

Greedy float32 and seeded sampling, across batch sizes, micro-batch sizes, positions in
the batch and reruns; plus the properties of the micro-batch balancer (paper Alg. 2).
"""

from __future__ import annotations

import random

import pytest
import torch

from moelight import LLM
from moelight.engine.batching import balance_microbatches, split_batches
from moelight.engine.generation import Engine
from moelight.loading.presets import preset_config
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts

N_NEW = 12
MODELS = {
    "tiny": preset_config("tiny"),
    # head_dim 64: a size the C++ attention kernels accept (when they build), so both backends are covered.
    "hd64": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=2, num_experts=4, top_k=2, head_dim=64, max_position_embeddings=512),
}
PROMPTS = random_prompts(31, 512, min_len=1, max_len=48, seed=7)
TARGET = PROMPTS[0]
OTHERS = PROMPTS[1:]
GREEDY = SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=N_NEW, temperature=0.8, top_p=0.9, top_k=20, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def engine(request):
    cfg = MODELS[request.param]
    model = build_model(cfg, torch.float32, None, seed=3)
    pack_model(model)  # as the runner and LLM do
    return Engine(model, cfg.eos_token_ids, max_prefill_tokens=64)


def run(engine, prompts, params, batch_size, micro_batch_size, seeds=None):
    seeds = list(range(len(prompts))) if seeds is None else seeds
    res = engine.generate(prompts, params, seeds, batch_size, micro_batch_size)
    assert [r.index for r in res] == list(range(len(prompts)))
    return [r.token_ids for r in res]


@pytest.fixture(scope="module")
def alone(engine):
    return run(engine, [TARGET], [GREEDY], 1, 1)[0]


def test_outputs_are_not_degenerate(engine, alone):
    assert len(alone) == N_NEW and len(set(alone)) >= 3, alone


@pytest.mark.parametrize(
    "n_others,position,batch_size,micro",
    [(1, 0, 2, 1), (1, 1, 2, 2), (30, 0, 31, 31), (30, 15, 31, 4), (30, 30, 8, 3), (30, 7, 16, 16)],
)
def test_greedy_output_independent_of_batch(engine, alone, n_others, position, batch_size, micro):
    prompts = list(OTHERS[:n_others])
    prompts.insert(position, TARGET)
    out = run(engine, prompts, [GREEDY] * len(prompts), batch_size, micro)
    assert out[position] == alone


def test_every_sequence_same_across_batch_layouts(engine):
    ref = run(engine, PROMPTS, [GREEDY] * len(PROMPTS), 31, 31)
    assert run(engine, PROMPTS, [GREEDY] * len(PROMPTS), 5, 2) == ref
    # reversed order, different batches: each sequence still gets its own answer
    rev = run(engine, PROMPTS[::-1], [GREEDY] * len(PROMPTS), 12, 5)
    assert rev[::-1] == ref


def test_seeded_sampling_independent_of_batch_and_reproducible(engine):
    seeds = [1000 + i for i in range(len(PROMPTS))]
    params = [sampled(s) for s in seeds]
    first = run(engine, PROMPTS, params, 31, 4)
    assert run(engine, PROMPTS, params, 31, 4) == first  # rerun
    assert run(engine, PROMPTS, params, 7, 3) == first  # other batch / micro-batch sizes
    alone = run(engine, [PROMPTS[5]], [params[5]], 1, 1)[0]
    assert alone == first[5]
    pair = run(engine, [PROMPTS[9], PROMPTS[5]], [params[9], params[5]], 2, 1)
    assert pair == [first[9], first[5]]
    # sampling really samples: other seeds give other tokens, and not all are the greedy ones
    other = run(engine, PROMPTS, [sampled(s + 1) for s in seeds], 31, 4)
    assert other != first
    greedy = run(engine, PROMPTS, [GREEDY] * len(PROMPTS), 31, 4)
    assert greedy != first


def test_engine_seeds_follow_the_request_not_its_position(engine):
    """With SamplingParams.seed unset, the seeds list passed in decides (the runner passes per-id seeds)."""
    params = [sampled(None)] * 3
    a = run(engine, PROMPTS[:3], params, 3, 3, seeds=[11, 12, 13])
    b = run(engine, PROMPTS[2::-1], params, 3, 2, seeds=[13, 12, 11])
    assert b[::-1] == a


def test_llm_seeded_sampling_across_compositions():
    llm = LLM("tiny", load_format="dummy", dtype="float32", batch_size=8, micro_batch_size=3)
    params = [sampled(50 + i) for i in range(10)]
    prompts = PROMPTS[:10]
    full = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == full
    sub = [o.outputs[0].token_ids for o in llm.generate(prompts[4:7], params[4:7])]
    assert sub == full[4:7]


# ----------------------------------------------------------------------------- balancer


@pytest.mark.parametrize("trial", range(40))
def test_balance_microbatches_properties(trial):
    rng = random.Random(trial)
    n = rng.randint(1, 60)
    lengths = [rng.randint(1, rng.choice([8, 100, 2000])) for _ in range(n)]
    k = rng.randint(1, 70)
    groups = balance_microbatches(lengths, k)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(n))  # every index exactly once
    assert len(groups) == min(k, n)  # no empty micro-batch, none more than asked
    assert all(g == sorted(g) and g for g in groups)
    loads = [sum(lengths[i] for i in g) for g in groups]
    # greedy longest-first: loads differ by at most the longest sequence
    assert max(loads) - min(loads) <= max(lengths)
    assert max(loads) <= sum(lengths) / len(groups) + max(lengths)


def test_balance_microbatches_examples():
    assert balance_microbatches([], 4) == []
    assert balance_microbatches([5], 3) == [[0]]
    assert balance_microbatches([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [[0], list(range(1, 11))]
    g = balance_microbatches([4, 4, 3, 3, 2, 2], 2)
    assert sorted(sum([4, 4, 3, 3, 2, 2][i] for i in grp) for grp in g) == [9, 9]


def test_split_batches():
    assert split_batches(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert split_batches(0, 3) == []
    assert [i for b in split_batches(100, 7) for i in b] == list(range(100))
