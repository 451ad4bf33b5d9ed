"""The scheduler alone (engine/scheduler.py): admission into the KV pool, refill at N/8 free slots,
balanced first placement, least-filled refill placement, prefill chunks, and finishing; and the
executor interface every executor implements (runtime/executor.py)."""

from __future__ import annotations

import inspect

import pytest

from moelight.engine.scheduler import Scheduler
from moelight.engine.sequence import Sequence
from moelight.sampling.params import SamplingParams


def _seqs(prompt_lens, max_tokens=4):
    return [Sequence(i, n, SamplingParams(max_tokens=max_tokens)) for i, n in enumerate(prompt_lens)]


def test_the_first_admission_fills_n_and_balances_micro_batches_by_tokens():
    sched = Scheduler(_seqs([10, 1, 1, 9, 1, 1, 8, 30]), batch_size=6, micro_batch_size=3)
    new = sched.admit()
    assert new == [0, 1, 2, 3, 4, 5]  # in request order, as many as N
    tokens = [sum(sched.seqs[j].prompt_len for j in mb) for mb in sched.decode_batches()]
    assert len(tokens) == 2 and sorted(tokens) == [11, 12]  # Alg. 2: longest first into the lightest
    assert sched.capacity == sum(sorted(s.kv_slots for s in sched.seqs)[-6:])  # holds any 6 of them


def test_refill_waits_for_n_over_8_free_slots_then_fills_the_least_filled_micro_batch():
    sched = Scheduler(_seqs([2] * 20), batch_size=16, micro_batch_size=4)
    first = sched.admit()
    assert len(first) == 16 and len(sched.decode_batches()) == 4
    sched.finish(first[0])
    assert sched.admit() == []  # 1 free slot < 16 / 8
    sched.finish(first[5])
    refill = sched.admit()
    assert refill == [16, 17]  # the next two, in order
    sizes = sorted(len(mb) for mb in sched.decode_batches())
    assert sizes == [4, 4, 4, 4]  # each went to a micro-batch a finished sequence had left


def test_finished_regions_are_reused_without_overlap():
    sched = Scheduler(_seqs([3, 5, 2, 4, 6, 1], max_tokens=2), batch_size=2, micro_batch_size=1)
    live: dict[int, tuple[int, int]] = {}
    order = []
    while True:
        for j in sched.admit():
            start = int(sched.kv.offsets[j])
            span = (start, start + sched.sizes[j])
            assert span[1] <= sched.capacity
            assert all(span[1] <= a or b <= span[0] for a, b in live.values())  # no overlap
            live[j] = span
            order.append(j)
        batches = sched.decode_batches()
        if not batches:
            break
        j = batches[0][0]
        assert sched.finish(j) == live.pop(j)[0]  # finish hands back the region's start (its KV offset)
    assert order == list(range(6)) and sched.kv.pool.free_slots == sched.capacity


def test_prefill_chunks_respect_the_token_cap_and_never_mix_micro_batches():
    sched = Scheduler(_seqs([5, 5, 5, 5, 5, 5]), batch_size=6, micro_batch_size=3)
    new = sched.admit()
    chunks = sched.prefill_chunks(new, max_tokens=10)
    assert sorted(j for c in chunks for j in c) == new
    assert all(sum(sched.seqs[j].prompt_len for j in c) <= 10 for c in chunks)
    groups = [set(mb) for mb in sched.decode_batches()]
    assert all(any(set(c) <= g for g in groups) for c in chunks)


def test_a_request_larger_than_the_pool_is_an_engine_bug_not_a_hang():
    sched = Scheduler(_seqs([4]), batch_size=1, micro_batch_size=1)
    sched.sizes[0] = sched.capacity + 1  # as if the pool were sized wrongly
    with pytest.raises(RuntimeError, match="pool"):
        sched.admit()


def test_a_sequence_ends_at_eos_a_stop_token_or_max_tokens():
    s = Sequence(0, 3, SamplingParams(max_tokens=3, stop_token_ids=[7]))
    assert not s.append(5, eos={2}) and s.append(7, eos={2}) and s.finish == "stop"
    s = Sequence(0, 3, SamplingParams(max_tokens=2, ignore_eos=True))
    assert not s.append(2, eos={2}) and s.append(2, eos={2}) and s.finish == "length"
    assert s.position == 3 + 2 - 1 and s.result().token_ids == [2, 2]


def test_ignore_eos_ignores_eos_only_and_an_eos_is_no_stop_reason():
    """vLLM: stop_token_ids still stop a sequence that ignores EOS; an EOS ends it with stop_reason None,
    even when it is also among stop_token_ids (unless EOS is ignored: then the stop id ends it)."""
    s = Sequence(0, 3, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[7]))
    assert not s.append(2, eos={2}) and s.append(7, eos={2})
    assert (s.finish, s.stop_reason) == ("stop", 7)
    s = Sequence(0, 3, SamplingParams(max_tokens=8, stop_token_ids=[2]))
    assert s.append(2, eos={2}) and (s.finish, s.stop_reason) == ("stop", None)
    s = Sequence(0, 3, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[2]))
    assert s.append(2, eos={2}) and (s.finish, s.stop_reason) == ("stop", 2)
    # generation_config.json's end ids beside the tokenizer's EOS: vLLM's stop_token_ids, named as stop_reason
    s = Sequence(0, 3, SamplingParams(max_tokens=8))
    assert s.append(7, eos={2, 7}, listed_eos=frozenset({7})) and (s.finish, s.stop_reason) == ("stop", 7)
    s = Sequence(0, 3, SamplingParams(max_tokens=8, ignore_eos=True))
    assert not s.append(7, eos={2, 7}, listed_eos=frozenset({7}))  # ignore_eos ignores them too, as vLLM


def test_stop_strings_wait_for_min_tokens_as_in_vllm():
    decode = lambda ids, skip, context=(): "".join(chr(96 + t) for t in ids)  # noqa: E731  token t is the letter t
    s = Sequence(0, 3, SamplingParams(max_tokens=8, min_tokens=3, stop=["b"]))
    assert not s.append(2, eos=set(), decode=decode)  # "b" inside min_tokens: no stop
    assert not s.append(1, eos=set(), decode=decode) and not s.append(1, eos=set(), decode=decode)  # 3 tokens
    assert s.append(2, eos=set(), decode=decode)  # the 4th token: longer than min_tokens, its "b" stops
    assert (s.finish, s.stop_reason, s.text) == ("stop", "b", "baa")  # the earlier "b" is kept, not matched


def test_every_executor_implements_the_one_interface():
    from moelight.expert_cache.cache_executor import ExpertCacheExecutor
    from moelight.pipeline.pipeline_executor import PipelineExecutor
    from moelight.runtime.executor import Executor
    from moelight.runtime.plain_executor import PlainExecutor

    for cls in (PlainExecutor, PipelineExecutor, ExpertCacheExecutor):
        assert issubclass(cls, Executor) and not inspect.isabstract(cls), cls
        for name in ("prefill", "decode", "release_sequence", "stats", "close"):
            assert callable(getattr(cls, name)), (cls, name)
    with pytest.raises(TypeError):
        type("Incomplete", (Executor,), {"prefill": lambda *a: None})()  # decode missing: not an executor
