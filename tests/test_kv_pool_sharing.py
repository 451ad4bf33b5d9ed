"""The paged KV pool counts a shared prefix once per distinct prefix live at once (runtime/paged_layout.pool_table),
not once per sequence: smaller than the unshared pool where prompts share pages (a few-shot prefix, the n samples
of one prompt), the same where they do not, and never too small for what the block manager holds: any `batch`
sequences at once fit, through every order of admission and release."""

from __future__ import annotations

import itertools
import random

import pytest

from moelight.engine.batching import split_batches
from moelight.engine.block_manager import PAGE_SIZE, BlockManager, block_hashes, pages_for
from moelight.engine.scheduler import Scheduler
from moelight.engine.sequence import Sequence
from moelight.planning.job_plan import kv_pool_table
from moelight.runtime.paged_layout import pool_slots, pool_table, prefix_pages, reserved_rooms
from moelight.sampling.params import SamplingParams

P = PAGE_SIZE


def _unshared(rooms: list[int], batch: int) -> int:
    return sum(reserved_rooms(rooms, True)[:batch])


def _scheduler(prompts, params, batch):
    seqs = [Sequence(i, len(p), q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    return Scheduler(seqs, batch, 4, prompts=prompts)


def test_a_64_token_shared_prefix_is_counted_once():
    """48 prompts behind one 64-token prefix (4 pages each may reuse), batch 16: 15 x 4 pages fewer than the
    unshared pool, in the scheduler's allocation and the planner's table alike (main: the unshared pool)."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(1 + i % 30)] for i in range(48)]
    params = [SamplingParams(max_tokens=32)] * len(prompts)
    rooms = [len(p) + 32 for p in prompts]
    sched = _scheduler(prompts, params, 16)
    assert sched.capacity == _unshared(rooms, 16) - 15 * 4 * P
    assert kv_pool_table(prompts, params, True)[15] == sched.capacity
    assert kv_pool_table(prompts, params, False)[15] == sum(sorted(rooms, reverse=True)[:16])  # ragged: as it was


def test_the_n_samples_of_a_prompt_hold_its_pages_once():
    """6 prompts of 20-100 tokens, 8 samples each, batch 16: each distinct prompt's pages once, each sample its
    generation's pages and the page holding its last prompt position (its own copy unless it is a twin)."""
    rng = random.Random(1)
    base = [[rng.randrange(3, 500) for _ in range(20 + 16 * k)] for k in range(6)]
    prompts = [p for p in base for _ in range(8)]
    params = [SamplingParams(max_tokens=64)] * len(prompts)
    rooms = [len(p) + 64 for p in prompts]
    private = sorted((pages_for(n) - (len(p) - 1) // P for n, p in zip(rooms, prompts, strict=True)), reverse=True)
    expected = (sum(private[:16]) + sum(pages_for(len(p)) for p in base)) * P
    sched = _scheduler(prompts, params, 16)
    assert sched.capacity == expected < _unshared(rooms, 16)
    assert kv_pool_table(prompts, params, True)[15] == expected


def test_distinct_prompts_and_prompt_logprobs_requests_keep_the_unshared_pool():
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))] for _ in range(30)]
    rooms = [len(p) + 7 for p in prompts]
    unshared = list(itertools.accumulate(reserved_rooms(rooms, True)))
    assert pool_table(rooms, True, prompts, [True] * 30) == unshared
    same = [prompts[0]] * 30  # they would share every page, but each computes its prompt (prompt_logprobs)
    assert pool_table([len(prompts[0]) + 7] * 30, True, same, [False] * 30) == [
        pages_for(len(prompts[0]) + 7) * P * b for b in range(1, 31)]


def test_the_counted_prefixes_are_the_most_pages_any_b_prompts_share():
    """The long-path decomposition's b longest paths against every b prompts' shared pages, counted by brute
    force on random prefix trees (prompts of whole pages drawn from a few, plus one token)."""
    rng = random.Random(3)
    for _ in range(40):
        blocks = [[rng.randrange(3, 500) for _ in range(P)] for _ in range(3)]
        prompts = [[t for _ in range(rng.randrange(0, 5)) for t in rng.choice(blocks)] + [1000 + i]  # all distinct
                   for i in range(rng.randrange(2, 9))]
        reused, chains = prefix_pages(prompts, [True] * len(prompts))
        held = [block_hashes(p) for p in prompts]
        shared = [set(h[:r]) for h, r in zip(held, reused, strict=True)]
        assert all(r == 0 or sum(h[r - 1] in o for o in held) >= 2 for h, r in zip(held, reused, strict=True))
        for b in range(1, len(prompts) + 1):
            best = max(len(set().union(*c)) for c in itertools.combinations(shared, b))
            assert sum(chains[:b]) == best


def test_any_batch_of_sequences_fits_the_pool_whatever_is_admitted_and_released():
    """Random prompts behind a few prefixes, some repeated (twins when admitted in one round), some without
    sharing; the pool the scheduler would allocate for `batch`; random releases (an owner may end before its
    twins copy their partial page): the block manager admits the next sequence whenever fewer than `batch` run,
    but while a twin whose owner ended holds the owner's partial page beside its own copy (until its first
    write: one page above its room, which the pool counts only where it is smaller than the unshared one)."""
    waits = 0
    for seed in range(1000):
        rng = random.Random(seed)
        systems = [[rng.randrange(3, 50) for _ in range(rng.choice([P, 2 * P, 3 * P, 40]))] for _ in range(3)]
        base = [rng.choice(systems + [[]]) for _ in range(rng.randrange(3, 12))]
        base = [s[:rng.randrange(0, len(s) + 1)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 25))]
                for s in base]
        prompts = [rng.choice(base) for _ in range(rng.randrange(4, 40))]
        share = [rng.random() > 0.1 for _ in prompts]
        rooms = [len(p) + rng.randrange(1, 30) for p in prompts]
        batch = rng.randrange(1, 9)
        bm = BlockManager(prompts, rooms, pool_table(rooms, True, prompts, share)[min(batch, len(prompts)) - 1] // P,
                          share)
        waiting, running = list(range(len(prompts))), []
        while waiting or running:
            bm.start_round()
            new = []
            while waiting and len(running) + len(new) < batch:
                if not bm.admit(waiting[0]):  # only while a twin holds its ended owner's page and its own copy
                    assert any(s.cow_page is not None and s.twin_of not in bm.seqs for s in bm.seqs.values()), seed
                    waits += 1
                    break
                new.append(waiting.pop(0))
            bm.computed([j for wave in bm.prefill_waves(new) for j in wave])
            running += new
            if rng.random() < 0.5:
                bm.copy_on_write({j: len(prompts[j]) for j in new})
            for j in rng.sample(running, k=rng.randrange(1, len(running) + 1)) if running else []:
                running.remove(j)
                bm.release(j)
    assert waits < 10


def test_a_pool_smaller_than_the_largest_sequence_is_refused_when_sized(monkeypatch):
    """An empty pool must admit any sequence, or admission could wait forever."""
    from moelight.engine import scheduler

    monkeypatch.setattr(scheduler, "pool_slots", lambda rooms, *a, **k: pages_for(max(rooms)) * P - P)
    with pytest.raises(RuntimeError, match="largest sequence"):
        _scheduler([[5] * 40, [6] * 20], [SamplingParams(max_tokens=8)] * 2, 2)


def test_a_static_batchs_pool_is_no_larger_than_the_jobs_at_that_batch():
    """refill=False runs the job in batches of `batch`, each with the pool of its own prompts; the planner and
    the check count the job's pool at `batch`, which must hold each of them (a batch may share less)."""
    for seed in range(500):
        rng = random.Random(seed)
        systems = [[rng.randrange(3, 50) for _ in range(rng.choice([P, 2 * P, 3 * P, 5 * P]))] for _ in range(3)]
        base = [rng.choice(systems + [[]]) for _ in range(rng.randrange(2, 8))]
        base = [s[:rng.randrange(0, len(s) + 1)] + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 40))]
                for s in base]
        prompts = [rng.choice(base) for _ in range(rng.randrange(3, 16))]
        rooms = [len(p) + rng.randrange(1, 60) for p in prompts]
        batch = rng.randrange(1, 6)
        job = pool_slots(rooms, batch, True, prompts)
        for run in map(list, split_batches(len(prompts), batch)):
            assert pool_slots([rooms[i] for i in run], batch, True, [prompts[i] for i in run]) <= job, seed
