"""Prefix sharing: the block manager's pages, hashes, waves and copy-on-write, and an engine that
pages its KV cache giving the same tokens as one that does not while computing shared prefixes once."""

from __future__ import annotations

import random

import pytest
import torch

from moelight.engine.block_manager import PAGE_SIZE, BlockManager, block_hashes, pages_for
from moelight.engine.generation import Engine, GenerationStats
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams

P = PAGE_SIZE


def _manager(prompts, capacities=None, pages=64, share=None):
    capacities = capacities or [len(p) + 8 for p in prompts]
    return BlockManager(prompts, capacities, pages, share or [True] * len(prompts))


def test_block_hashes_name_whole_prefixes():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    assert len(block_hashes(a)) == 2 and block_hashes(a)[:2] == block_hashes(b)[:2]
    c = [7] + list(range(1, 40))  # differs in the first page: every later page differs too
    assert not set(block_hashes(a)) & set(block_hashes(c))


def test_full_prompt_pages_are_reused_and_the_last_position_is_always_computed():
    sys_prompt = list(range(100, 100 + 2 * P))
    prompts = [sys_prompt + [1, 2, 3], sys_prompt + [4], sys_prompt, sys_prompt[:P]]
    bm = _manager(prompts)
    for j in range(4):
        assert bm.admit(j)
    assert [bm.cached(j) for j in range(4)] == [0, 2 * P, P, 0]  # never the page holding the last position
    assert bm.seqs[1].pages[:2] == bm.seqs[0].pages[:2] and bm.seqs[2].pages[:1] == bm.seqs[0].pages[:1]
    # the reusers read pages sequence 0 has not computed yet: they come in a later wave
    assert bm.prefill_waves([0, 1, 2, 3]) == [[0, 3], [1, 2]]


def test_twins_share_every_prompt_page_and_copy_the_partial_one_before_writing_it():
    prompt = list(range(2 * P + 5))  # two full pages and a partial one
    bm = _manager([prompt, prompt, prompt])
    assert all(bm.admit(j) for j in range(3))
    assert bm.prefill_waves([0, 1, 2]) == [[0]] and bm.twins(0) == [1, 2]
    shared = bm.seqs[0].pages[:3]
    assert all(bm.seqs[j].pages[:3] == shared for j in (1, 2)) and bm.refs[shared[2]] == 3
    copies = bm.copy_on_write({j: len(prompt) for j in range(3)})  # the first decode writes position 37
    assert [src for src, _ in copies] == [shared[2], shared[2]]
    assert bm.seqs[1].pages[2] != shared[2] and bm.seqs[2].pages[2] != shared[2]
    assert bm.seqs[0].pages[2] == shared[2] and bm.refs[shared[2]] == 1
    assert bm.copy_on_write({j: len(prompt) + 1 for j in range(3)}) == []  # copied once


def test_a_prompt_of_whole_pages_needs_no_copy():
    prompt = list(range(2 * P))
    bm = _manager([prompt, prompt])
    assert bm.admit(0) and bm.admit(1)
    assert bm.seqs[1].cow_page is None and bm.copy_on_write({0: 2 * P, 1: 2 * P}) == []


def test_prompt_logprobs_requests_reuse_nothing_but_name_their_pages():
    prompt = list(range(3 * P))
    bm = _manager([prompt, prompt, prompt], share=[False, True, False])
    assert all(bm.admit(j) for j in range(3))
    assert [bm.cached(j) for j in range(3)] == [0, 2 * P, 0] and bm.twins(0) == []


def test_named_pages_outlive_their_sequence_until_the_room_is_needed():
    sys_prompt = list(range(2 * P))
    bm = _manager([sys_prompt + [1], sys_prompt + [2], list(range(500, 500 + 40 * P))], pages=42)
    assert bm.admit(0)
    bm.prefill_waves([0])
    bm.computed([0])
    bm.release(0)
    assert bm.admit(1) and bm.cached(1) == 2 * P  # found after its owner finished
    bm.release(1)
    assert bm.admit(2)  # 41 pages: the two named ones are evicted to make room
    assert bm.by_hash.keys() == set(block_hashes(list(range(500, 500 + 40 * P))))


def test_admission_waits_for_room_and_a_drained_pool_is_whole_again():
    prompts = [list(range(j, j + 20)) for j in range(5)]
    bm = _manager(prompts, pages=pages_for(28) * 2)
    assert bm.admit(0) and bm.admit(1) and not bm.admit(2)
    bm.computed([0, 1])
    bm.release(0)
    assert bm.admit(2)
    for j in (1, 2):
        bm.release(j)
    assert bm.pool.free_slots + len(bm.evictable) == bm.pool.capacity and not any(bm.refs)


# ---- the engine, paged against ragged ----
CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  num_experts=4, top_k=2, head_dim=64, max_position_embeddings=512)


@pytest.fixture(scope="module", params=["mixtral", "deepseek"])
def model(request):
    """A GQA model, and DeepSeek's MLA: its latent rows paged, copied on write, a cached prefix expanded."""
    cfg = CFG
    if request.param == "deepseek":
        from moelight.loading.hf_config import config_from_hf_dict
        from tests.test_deepseek_paths import KERNEL_SHAPE

        cfg = config_from_hf_dict({**KERNEL_SHAPE, "vocab_size": 512})
    m = build_model(cfg, torch.float32, None, seed=3)
    pack_model(m)
    return m


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(45)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for _ in range(9)]
    return prompts + [prompts[0]] * 3 + [system[:32], system[:32], system[:40], [5]]


def _run(model, prompts, params, share, batch=6, micro=2, refill=True, chunk=64):
    stats = GenerationStats()
    engine = Engine(model, CFG.eos_token_ids, chunk, refill=refill, prefix_sharing=share)
    res = engine.generate(prompts, params, list(range(len(prompts))), batch, micro, stats=stats)
    return res, stats


@pytest.mark.parametrize("batch,micro,refill,chunk", [(6, 2, True, 64), (16, 4, True, 40), (3, 1, True, 512),
                                                      (5, 5, False, 64)])
def test_paged_engine_gives_the_ragged_engines_tokens(model, batch, micro, refill, chunk):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(prompts)
    ragged, rs = _run(model, prompts, params, False, batch, micro, refill, chunk)
    paged, ps = _run(model, prompts, params, True, batch, micro, refill, chunk)
    assert [r.token_ids for r in paged] == [r.token_ids for r in ragged]
    assert rs.prefix_reused_tokens == 0 and rs.prefill_computed_tokens == sum(map(len, prompts))
    assert ps.prefix_reused_tokens > 0
    assert ps.prefill_computed_tokens + ps.prefix_reused_tokens == sum(map(len, prompts))


def test_n_samples_computed_once_sample_as_if_alone(model):
    """Four seeded samples of one prompt (twins) and two sampled requests behind a shared prefix:
    the same tokens as without sharing, and the prompt is prefilled once."""
    prompts = _prompts()
    base = prompts[1]
    prompts = [base] * 4 + prompts[2:4]
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=10 + k, ignore_eos=True)
              for k in range(len(prompts))]
    ragged, _ = _run(model, prompts, params, False)
    paged, ps = _run(model, prompts, params, True)
    assert [r.token_ids for r in paged] == [r.token_ids for r in ragged]
    assert len({tuple(r.token_ids) for r in paged[:4]}) > 1  # the samples differ from each other
    assert ps.prefill_computed_tokens < len(base) + sum(map(len, prompts[4:]))


@pytest.mark.parametrize("refill", [True, False])
def test_a_pool_too_tight_for_the_batch_makes_admission_wait_with_the_same_tokens(model, monkeypatch, refill):
    """The paged pool cut to the largest sequence's pages, as if sharing had turned out far smaller than counted
    (prefixes recycled): admission waits for running sequences to finish instead of failing, the twins of
    prompts[0] may be split across rounds, and the tokens are still the ragged engine's."""
    from moelight.engine import scheduler

    real = scheduler.pool_slots

    def tight(rooms, batch, paged, *args, **kwargs):
        return real(rooms, 1, paged) if paged else real(rooms, batch, paged, *args, **kwargs)

    monkeypatch.setattr(scheduler, "pool_slots", tight)
    prompts = _prompts()
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=k, ignore_eos=True) for k in range(len(prompts))]
    ragged, rs = _run(model, prompts, params, False, 6, 2, refill)
    paged, ps = _run(model, prompts, params, True, 6, 2, refill)
    assert [r.token_ids for r in paged] == [r.token_ids for r in ragged]
    assert len(ps.batches) > len(rs.batches) + 3  # admitted a few at a time
    assert ps.prefix_reused_tokens > 0


def test_prompt_logprobs_and_logprobs_are_unchanged_by_sharing(model):
    prompts = _prompts()[:6] + [_prompts()[0]]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if k % 2 else None) for k in range(len(prompts))]
    ragged, _ = _run(model, prompts, params, False)
    paged, _ = _run(model, prompts, params, True)
    for a, b in zip(ragged, paged, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None and y is None) or all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


def test_sliding_window_and_sinks_through_pages():
    """GPT-OSS's window and sinks over a shared prefix (the reference attention path)."""
    from moelight.loading.presets import preset_config

    cfg = preset_config("bench-gpt-oss")
    small = ModelConfig(**{**cfg.__dict__, "num_layers": 2, "vocab_size": 512, "hidden_size": 64,
                           "intermediate_size": 64, "num_experts": 4, "top_k": 2, "sliding_window": 8,
                           "max_position_embeddings": 512})
    m = build_model(small, torch.float32, None, seed=5)
    prompts = _prompts()[:8]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * len(prompts)
    outs = []
    for share in (False, True):
        engine = Engine(m, small.eos_token_ids, 64, prefix_sharing=share)
        outs.append([r.token_ids for r in engine.generate(prompts, params, list(range(8)), 4, 2)])
    assert outs[0] == outs[1]


# ---- the HRM and the planner ----
def test_planning_estimate_is_what_the_block_manager_reuses_in_one_round():
    from moelight.runtime.paged_layout import shared_prefix_tokens

    prompts = _prompts()
    share = [True] * len(prompts)
    bm = _manager(prompts, pages=400)
    assert all(bm.admit(j) for j in range(len(prompts)))
    assert shared_prefix_tokens(prompts, share) == [bm.cached(j) for j in range(len(prompts))]
    assert shared_prefix_tokens(prompts, [False] * len(prompts)) == [0] * len(prompts)


def test_a_shared_prefix_is_not_recomputed_in_the_hrm_but_its_pool_is_reserved():
    """Same job with 512 of its 700 prompt tokens shared: less prefill time, so more tokens per second. A workload
    given as figures has no pool table (kv_pool): a mean shared prefix does not say how many distinct prefixes
    are live at once, so its KV memory stays every sequence's room and on a host whose memory bounds the batch
    the planner picks the same N (the next test: a job's prompts do say)."""
    from dataclasses import replace

    from hrm import WorkloadSpec
    from hrm.hardware_presets import HARDWARE_PRESETS
    from hrm.model_presets import MODEL_PRESETS
    from optimizer import plan, predict_job
    from optimizer.cost_model import build_point_model

    hw, m = HARDWARE_PRESETS["cpu-server"], MODEL_PRESETS["mixtral-8x7b"]
    alone, shared = WorkloadSpec(700, 128, 800), WorkloadSpec(700, 128, 800, shared_prefix=512)
    a = build_point_model(hw, m, alone, "bfloat16", 64, 1, 0, 0)
    b = build_point_model(hw, m, shared, "bfloat16", 64, 1, 0, 0)
    assert float(b.prefill_time(0, 0)) < 0.5 * float(a.prefill_time(0, 0))
    kv = [pm.cpu_mem["kv_cache"].c0 for pm in (a, b)]
    assert kv[1] == kv[0]
    small = replace(hw, cpu=replace(hw.cpu, memory_bytes=110 * 2**30))
    pa, pb = plan(small, m, alone, "bfloat16").policy, plan(small, m, shared, "bfloat16").policy
    assert pb.batch_size == pa.batch_size
    rate = [predict_job(small, m, w, p, 1000)["end_to_end_tokens_per_s"] for w, p in ((alone, pa), (shared, pb))]
    assert rate[1] > rate[0]
    with pytest.raises(ValueError, match="shared_prefix"):
        WorkloadSpec(100, 8, shared_prefix=200)


def test_the_planner_picks_a_larger_batch_where_the_jobs_prompts_share_a_prefix():
    """400 prompts of 700 tokens behind one 512-token prefix, 128 new tokens, on a host whose memory bounds the
    batch: the pool the engine allocates counts the prefix once (runtime/paged_layout.pool_table), so the planner
    fits about twice the batch it fits without sharing (main: 84 either way)."""
    from dataclasses import replace

    from hrm.hardware_presets import HARDWARE_PRESETS
    from hrm.model_presets import MODEL_PRESETS
    from moelight.planning.job_plan import workload_of
    from optimizer import plan

    hw, m = HARDWARE_PRESETS["cpu-server"], MODEL_PRESETS["mixtral-8x7b"]
    small = replace(hw, cpu=replace(hw.cpu, memory_bytes=110 * 2**30))
    rng = random.Random(0)
    prefix = [rng.randrange(3, 30000) for _ in range(512)]
    prompts = [prefix + [rng.randrange(3, 30000) for _ in range(188)] for _ in range(400)]
    params = [SamplingParams(max_tokens=128)] * len(prompts)
    alone, shared = (plan(small, m, workload_of(prompts, params, None, sharing), "bfloat16").policy.batch_size
                     for sharing in (False, True))
    assert shared > 1.5 * alone


def test_the_managers_indexes_agree_with_its_sequences_through_random_rounds():
    """twins(), the pending pages by owner and the spare-page count are kept as indexes (a job of
    thousands of sequences scanned every sequence per call): each agrees with a scan of the state."""
    rng = random.Random(1)
    system = list(range(100, 100 + 3 * P))
    prompts = [system[:rng.choice([P, 2 * P, 3 * P])] + [rng.randrange(3, 90) for _ in range(rng.randrange(0, 20))]
               for _ in range(120)]
    prompts += [prompts[i] for i in range(0, 120, 7)]  # equal prompts: twins when admitted in one round
    bm = _manager(prompts, pages=60)
    waiting, running = list(range(len(prompts))), []
    while waiting or running:
        bm.start_round()
        new = []
        while waiting and bm.admit(waiting[0]):
            new.append(waiting.pop(0))
        for j in new:
            assert bm.twins(j) == [t for t, s in bm.seqs.items() if s.twin_of == j]
        bm.computed([j for wave in bm.prefill_waves(new) for j in wave])
        assert all(o in bm.seqs and bm.seqs[o].twin_of is None for o in bm.pending.values())
        assert not any(o in new for o in bm.pending.values())  # every computed owner's pages are ready
        running += new
        for j in rng.sample(running, k=max(1, len(running) // 2)) if running else []:
            running.remove(j)
            bm.release(j)
        held = {p for s in bm.seqs.values() for p in s.pages + ([s.cow_page] if s.cow_page is not None else [])}
        assert bm.pool.free_slots + len(bm.evictable) + len(held) == bm.pool.capacity
    assert not any(bm.refs) and not bm.seqs and not bm.twins_of
