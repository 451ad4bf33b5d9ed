"""Tensor parallelism over processes: N ranks joined by gloo, each running the CGOPipe runtime
(every schedule) on its own emulated device over its shard, give the plain engine's greedy
float32 tokens on the whole model, and every prefill and decode pass's logits within rtol 1e-4, not
bit for bit: a rank's O projection and FFN sum over its part of the heads / expert width, and the
all-reduce adds the parts, an order of additions one device's matmul does not use. The same
comparison fails when a rank swaps one paged expert or drops one micro-batch's attention output."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts
from tests.runtime_check import Run, assert_same_run, run_job
from tests.tp_helpers import family_config, random_model

PROMPTS = random_prompts(7, 300, min_len=2, max_len=14, seed=11)
# unequal lengths: sequences finish early and the refill admits the waiting ones
PARAMS = [SamplingParams(max_tokens=3 + (k % 3) * 2, temperature=0.0, ignore_eos=True) for k in range(len(PROMPTS))]
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


def _run(model, schedule: str, r_w: float, compute_in_order: bool = False, fault: str = "", device="emulated",
         index: int = 0):
    """The job's run (tokens, every pass's logits) on the runtime, with a fault if asked."""
    kwargs = EXEC_KW if device == "emulated" else {k: v for k, v in EXEC_KW.items() if not k.endswith("bandwidth")}
    if device == "cuda":
        kwargs = {**kwargs, "index": index}
    ex = PipelineExecutor(model, schedule, device, r_w=r_w, compute_in_order=compute_in_order, **kwargs)
    try:
        if fault == "swap":
            from tests.runtime_check import swap_paged_experts

            swap_paged_experts(ex.pager)
        return run_job(model, ex, PROMPTS, PARAMS, 4, 2, max_prefill_tokens=48)
    finally:
        ex.close()


def _drop_attention() -> None:
    from tests.runtime_check import drop_attention

    class Patch:  # pytest's monkeypatch, in a rank's process
        def setattr(self, target, name, value):
            setattr(target, name, value)

    drop_attention(Patch())


def _rank_main(rank: int, n: int, port: int, cases, dtype, results, fault: str = "", device="emulated") -> None:
    """One rank: join the group, then every case over its shard; rank 0 reports."""
    from moelight.parallel import shard_model
    from moelight.parallel.rank_group import join_group

    torch.set_num_threads(1)
    if fault == "drop" and rank == 1:
        _drop_attention()
    group = join_group(device, rank, n, f"tcp://127.0.0.1:{port}")
    out = []
    for name, schedule, r_w in cases:
        full = random_model(family_config(name), dtype, seed=5)
        part = shard_model(full, rank, n, group.all_reduce)
        del full
        out.append(_run(part, schedule, r_w, compute_in_order=True, fault=fault if rank == 1 else "", device=device,
                        index=group.torch_device_index))
    if rank == 0:  # by value: tensors would be shared through this process, which is about to exit
        results.put([(r.tokens, [(k, t.float().numpy()) for k, t in r.logits]) for r in out])
    group.barrier()
    torch.distributed.destroy_process_group()


def _ranks(n: int, cases, dtype=torch.float32, fault: str = "", device: str = "emulated"):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_rank_main, args=(n, _free_port(), cases, dtype, results, fault, device), nprocs=n,
                               join=False, start_method="spawn")
    out = results.get(timeout=300)
    procs.join(timeout=60)
    return [Run(tokens, [(k, torch.from_numpy(a).to(dtype)) for k, a in logits]) for tokens, logits in out]


@pytest.fixture(scope="module")
def plain_engine():
    """Each case's job on the plain CPU engine over the whole model."""
    return [run_job(random_model(family_config(name), seed=5), None, PROMPTS, PARAMS, 4, 2, max_prefill_tokens=48)
            for name, _, _ in CASES]


# four ranks split heads, KV heads and expert widths in quarters; the schedules do not depend on the
# rank count, so four ranks run one schedule per family and two ranks run every schedule
FOUR_RANK_CASES = [i for i, (name, schedule, r_w) in enumerate(CASES)
                   if name != "mixtral" or (schedule, r_w) == ("cgopipe", 0.5)]


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_give_the_plain_engines_tokens_and_logits_on_every_schedule(plain_engine, n):
    chosen = range(len(CASES)) if n == 2 else FOUR_RANK_CASES
    got = _ranks(n, [CASES[i] for i in chosen])
    for i, run in zip(chosen, got, strict=True):
        assert_same_run(run, plain_engine[i], rtol=1e-4, atol=1e-4, what=str(CASES[i]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ranks_on_gpus_over_nccl_give_the_plain_engines_logits(plain_engine):
    from tests.runtime_check import assert_close_run_on_gpu

    for case, ref, got in zip(CASES, plain_engine, _ranks(2, CASES, device="cuda"), strict=True):
        assert_close_run_on_gpu(got, ref, what=str(case))


@pytest.mark.parametrize("fault", ["swap", "drop"])
def test_the_comparison_catches_a_rank_that_swaps_an_expert_or_drops_attention(plain_engine, fault):
    case = [CASES[1]]  # Mixtral, CGOPipe, half the experts paged
    (got,) = _ranks(2, case, fault=fault)
    with pytest.raises(AssertionError):
        assert_same_run(got, plain_engine[1], rtol=1e-4, atol=1e-4)


def test_bfloat16_ranks_stay_within_bfloat16s_own_rounding():
    """Tokens can flip at bf16 near-ties (see bf16_within_its_own_rounding): compare logits."""
    from tests.test_tp_sharding import bf16_within_its_own_rounding

    case = [("mixtral", "cgopipe", 0.25)]
    (tp,) = _ranks(2, case, torch.bfloat16)
    single, f32 = (_run(random_model(family_config("mixtral"), dt, seed=5), "cgopipe", 0.25)
                   for dt in (torch.bfloat16, torch.float32))
    bf16_within_its_own_rounding(tp.logits[0][1], single.logits[0][1], f32.logits[0][1])
