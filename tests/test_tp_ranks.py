"""Tensor parallelism over processes: N ranks joined by gloo, each running the CGOPipe runtime
(every schedule) on its own emulated device over its shard, give the single-device run's greedy
float32 tokens. Prefill logits agree within rtol 1e-4, not bit for bit: a rank's O projection
and FFN sum over its part of the heads / expert width, and the all-reduce adds the parts, an
order of additions one device's matmul does not use."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from moelight.engine.generation import Engine
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.runtime.latent_kv_cache import kv_cache_class
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts
from tests.tp_helpers import family_config, random_model

PROMPTS = random_prompts(7, 300, min_len=2, max_len=14, seed=11)
# unequal lengths: sequences finish early and the refill admits the waiting ones
PARAMS = [SamplingParams(max_tokens=3 + (k % 3) * 2, ignore_eos=True) for k in range(len(PROMPTS))]
EXEC_KW = dict(max_prefill_tokens=48, max_prompt_len=16, max_batch=8, max_context=64,
               h2d_bandwidth=4e9, d2h_bandwidth=4e9)
# (family, schedule, r_w): every schedule on Mixtral; OLMoE all-reduces inside pre-attention
# (its q/k norm spans the heads of every rank); GPT-OSS's sinks and windows on CPU and GPU attention;
# DeepSeek's MLA: heads split, each rank's CPU attention over its own copy of the latent
CASES = [("mixtral", s, r_w) for s in SCHEDULES for r_w in (0.0, 0.5)] + [
    ("olmoe-full-qk-norm-clip", "cgopipe", 0.25), ("gpt_oss-sinks-window-biases", "cgopipe", 0.0),
    ("gpt_oss-sinks-window-biases", "flexgen", 0.5), ("deepseek_v3-mla-groups-shared-dense", "cgopipe", 0.25)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model, schedule: str, r_w: float, compute_in_order: bool = False):
    """(prefill logits of the prompts, greedy tokens of the job) on the emulated runtime."""
    ex = PipelineExecutor(model, schedule, "emulated", r_w=r_w, compute_in_order=compute_in_order, **EXEC_KW)
    try:
        lens = torch.tensor([len(p) for p in PROMPTS[:3]])
        cache = kv_cache_class(model.config).pool(model.config, int(lens.sum()), model.embed_tokens.weight.dtype)
        logits = ex.prefill(cache, torch.tensor([t for p in PROMPTS[:3] for t in p]), lens,
                            torch.cumsum(lens, 0) - lens)
        out = Engine(model, (2,), max_prefill_tokens=48, executor=ex).generate(
            PROMPTS, PARAMS, [0] * len(PROMPTS), batch_size=4, micro_batch_size=2)
        return logits, [r.token_ids for r in out]
    finally:
        ex.close()


def _rank_main(rank: int, n: int, port: int, cases, dtype, results) -> None:
    """One rank: join the group, then every case over its shard; rank 0 reports."""
    from moelight.parallel import shard_model
    from moelight.parallel.rank_group import join_group

    torch.set_num_threads(1)
    group = join_group("emulated", rank, n, f"tcp://127.0.0.1:{port}")
    out = []
    for name, schedule, r_w in cases:
        full = random_model(family_config(name), dtype, seed=5)
        part = shard_model(full, rank, n, group.all_reduce)
        del full
        out.append(_run(part, schedule, r_w, compute_in_order=True))
    if rank == 0:
        results.put(out)
    group.barrier()
    torch.distributed.destroy_process_group()


def _ranks(n: int, cases, dtype=torch.float32):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_rank_main, args=(n, _free_port(), cases, dtype, results), nprocs=n,
                               join=False, start_method="spawn")
    out = results.get(timeout=300)
    procs.join(timeout=60)
    return out


@pytest.fixture(scope="module")
def single_device():
    return [_run(random_model(family_config(name), seed=5), schedule, r_w) for name, schedule, r_w in CASES]


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_give_the_single_device_tokens_for_every_schedule(single_device, n):
    got = _ranks(n, CASES)
    for case, (ref_logits, ref_tokens), (logits, tokens) in zip(CASES, single_device, got, strict=True):
        assert tokens == ref_tokens, case
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4, msg=str(case))


def test_bfloat16_ranks_stay_within_bfloat16s_own_rounding():
    """Tokens can flip at bf16 near-ties (see bf16_within_its_own_rounding): compare logits."""
    from tests.test_tp_sharding import bf16_within_its_own_rounding

    case = [("mixtral", "cgopipe", 0.25)]
    (tp, _), = _ranks(2, case, torch.bfloat16)
    (single, _), (f32, _) = (_run(random_model(family_config("mixtral"), dt, seed=5), "cgopipe", 0.25)
                             for dt in (torch.bfloat16, torch.float32))
    bf16_within_its_own_rounding(tp, single, f32)
