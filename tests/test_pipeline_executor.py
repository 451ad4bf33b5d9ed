"""The CGOPipe runtime on the strict emulated device: the plain engine's greedy tokens and, pass by
pass, its prefill and decode logits, on weights with structure (tp_helpers.random_model), with the
device's memory checked against bytes counted from the model; and the faults these checks catch."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from cpu_kernels.varlen_attention import varlen_attention
from moelight.devices.device_base import DeviceOutOfMemory, StreamOrderError
from moelight.engine.generation import GenerationStats
from moelight.models.config import ModelConfig
from moelight.pipeline.memory_plan import held_bytes_per_token
from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.pipeline.schedule import SCHEDULES
from moelight.sampling.params import SamplingParams
from tests.conftest import device_kinds
from tests.runtime_check import (
    assert_close_run_on_gpu,
    assert_same_run,
    drop_attention,
    run_job,
    swap_paged_experts,
)
from tests.tp_helpers import random_model

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    num_experts=4,
    top_k=2,
    head_dim=16,
    max_position_embeddings=512,
)
EXEC_KW = dict(
    max_prefill_tokens=32,
    max_prompt_len=16,
    max_batch=8,
    max_sequences=9,
    max_context=64,
    h2d_bandwidth=2e9,
    d2h_bandwidth=2e9,
)


@pytest.fixture(scope="module")
def setup():
    model = random_model(CFG, seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 14))] for _ in range(9)]
    # unequal lengths: some sequences finish early, so micro-batches shrink and vanish
    params = [SamplingParams(max_tokens=3 + (k % 4) * 2, temperature=0.0, ignore_eos=True)
              for k in range(len(prompts))]
    ref = run_job(model, None, prompts, params, 9, 2, max_prefill_tokens=32)
    return model, prompts, params, ref


def static_bytes(model, r_w: float) -> int:
    """Weights a runtime keeps on the device, from the model: non-expert parameters, the resident
    experts of every layer, two slots of one layer's paged experts."""
    c = model.config
    expert = 3 * c.hidden_size * c.intermediate_size * model.embed_tokens.weight.element_size()
    non_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if not n.endswith(("gate_up_proj", "down_proj")))
    r = round(r_w * c.num_experts)
    return non_expert + c.num_layers * r * expert + 2 * (c.num_experts - r) * expert


def assert_job_fails(ex, model, prompts, params, error: type[BaseException], match: str) -> None:
    """The job on `ex` raises `error` (its message matching `match`); the executor is closed after."""
    try:
        with pytest.raises(error, match=match):
            run_job(model, ex, prompts, params, 9, 2, max_prefill_tokens=32)
    finally:
        ex.close()


def check_memory(ex, model, r_w: float, prefill_tokens: int) -> None:
    """After a run: a peak above the weights by at least a prefill chunk's hidden states (activations
    are counted) and within the memory plan (which bounds them)."""
    static = static_bytes(model, r_w)
    el = model.embed_tokens.weight.element_size()
    assert ex.device.memory_peak - static >= prefill_tokens * model.config.hidden_size * el
    assert ex.device.memory_peak <= static + ex.plan.activations + ex.plan.kv_buffers


def executor(model, schedule: str, r_w: float, device: str, **kwargs) -> PipelineExecutor:
    """The runtime on `device`; on CUDA over a copy of the model (its non-expert modules move to the GPU)."""
    if device == "cuda":
        model = copy.deepcopy(model)
        kwargs = {k: v for k, v in {**EXEC_KW, **kwargs}.items() if not k.endswith("bandwidth")}
        return PipelineExecutor(model, schedule, "cuda", r_w=r_w, **kwargs)
    return PipelineExecutor(model, schedule, "emulated", r_w=r_w, **{**EXEC_KW, **kwargs})


@pytest.mark.parametrize("device", device_kinds())
@pytest.mark.parametrize("r_w", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tokens_and_logits_match_the_plain_engine_within_memory(setup, schedule, r_w, device):
    model, prompts, params, ref = setup
    ex = executor(model, schedule, r_w, device)
    try:
        if device == "emulated":
            assert ex.device.memory_used == static_bytes(model, r_w)  # the weights, counted from the model
        got = run_job(ex.model, ex, prompts, params, 9, 2, max_prefill_tokens=32)
        if device == "emulated":
            assert_same_run(got, ref, what=f"{schedule} r_w={r_w}")
            check_memory(ex, model, r_w, prefill_tokens=32)
        else:  # CUDA's allocator rounds blocks and adds cuBLAS workspaces: the weights are a lower bound
            assert_close_run_on_gpu(got, ref, what=f"{schedule} r_w={r_w}")
            assert ex.device.memory_peak >= static_bytes(model, r_w)
        assert ex.pager.n_resident == round(r_w * CFG.num_experts)
        graph, events = ex.last_pass
        assert graph.name == schedule and all(e.done and e.error is None for e in events)
        if r_w < 1:
            assert graph.find("w_h2d")  # the paged experts really moved
        stats = ex.stats()
        assert stats["gpu_lane_syncs_per_step"] == 0 and stats["pageable_copies"] == 0
    finally:
        ex.close()


def test_two_batches_and_the_carried_weight_slot(setup):
    """Layer 0's pages are prefetched by each pass for the next one, across batches."""
    model, prompts, params, _ = setup
    ref = run_job(model, None, prompts, params, 4, 3, max_prefill_tokens=32)
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.25, **EXEC_KW)
    try:
        assert_same_run(run_job(model, ex, prompts, params, 4, 3, max_prefill_tokens=32), ref)
        assert ex.first_loaded
    finally:
        ex.close()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_refilled_batches_on_every_schedule(setup, schedule):
    """Finished sequences' slots refilled mid-run (prefill between decode steps) on the runtime."""
    model, prompts, params, _ = setup
    ref = run_job(model, None, prompts, params, 4, 2, max_prefill_tokens=32)
    ex = PipelineExecutor(model, schedule, "emulated", r_w=0.5, **EXEC_KW)
    try:
        stats = GenerationStats()
        got = run_job(model, ex, prompts, params, 4, 2, max_prefill_tokens=32, stats=stats)
        assert_same_run(got, ref, what=schedule)
        assert len(stats.batches) > 3  # more prefill waves than the 3 static batches of 4
        check_memory(ex, model, 0.5, prefill_tokens=max(len(p) for p in prompts))
    finally:
        ex.close()


@pytest.mark.parametrize("schedule", ["cgopipe", "flexgen"])
def test_the_gpu_prefill_path_gives_the_plain_engine_s_run(setup, schedule, monkeypatch):
    """Prefill attention as a GPU runs it (varlen_attention's length-sorted groups, the fused kernel)
    instead of the CPU kernels the emulated device otherwise calls."""
    from moelight.devices import device_attention

    model, prompts, params, ref = setup
    monkeypatch.setattr(device_attention, "GPU_PATH_ON_CPU", True)
    calls = []
    monkeypatch.setattr(device_attention, "varlen_attention",
                        lambda *a, **k: calls.append(k["fused"]) or varlen_attention(*a, **k))
    ex = PipelineExecutor(model, schedule, "emulated", r_w=0.5, **EXEC_KW)
    try:
        assert_same_run(run_job(model, ex, prompts, params, 9, 2, max_prefill_tokens=32), ref, what=schedule)
    finally:
        ex.close()
    assert calls and all(calls)


@pytest.mark.parametrize("fault", ["swapped paged expert", "dropped attention output"])
def test_the_comparison_catches_a_runtime_fault(setup, fault, monkeypatch):
    model, prompts, params, ref = setup
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, **EXEC_KW)
    try:
        if fault == "swapped paged expert":
            swap_paged_experts(ex.pager)
        else:
            drop_attention(monkeypatch)
        with pytest.raises(AssertionError):
            assert_same_run(run_job(model, ex, prompts, params, 9, 2, max_prefill_tokens=32), ref)
    finally:
        ex.close()


def test_the_old_copy_pairing_is_a_race_the_device_reports(setup, monkeypatch):
    """The attention output allocated on the compute lane's pool and filled by the copy lane (the
    CUDA runtime's first version): on a GPU the block may still be read by queued compute."""
    from moelight.pipeline.pass_tasks import PassTasks

    def old_to_device(self, host, tag):
        dst = self.dev.empty(host.shape, host.dtype, tag, lane="gpu")
        self.dev.copy(dst, host)
        return dst

    model, prompts, params, _ = setup
    monkeypatch.setattr(PassTasks, "to_device", old_to_device)
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, **EXEC_KW)
    assert_job_fails(ex, model, prompts, params, StreamOrderError, "allocate it on the h2d lane")


def test_a_budget_for_the_planned_tensors_alone_is_exceeded(setup):
    """Weights plus the tensors a pass hands between its tasks, without kernels' temporaries: the
    device counts the temporaries too, so this budget fails where the memory plan's holds."""
    model, prompts, params, _ = setup
    held = 32 * held_bytes_per_token(CFG, torch.float32) + 9 * 4 * CFG.vocab_size
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, device_memory=static_bytes(model, 0.5) + held,
                          **EXEC_KW)
    assert_job_fails(ex, model, prompts, params, DeviceOutOfMemory, "temporaries included")


def test_a_closed_executor_holds_no_device_memory_for_an_engine_that_keeps_it(setup):
    """A tensor-parallel follower (or a caller) may still hold the old engine while the next
    executor is built: closing the executor must let its device tensors go."""
    import gc
    import weakref

    from moelight.engine.generation import Engine

    model, *_ = setup
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.5, **EXEC_KW)
    old_engine = Engine(model, (2,), executor=ex)  # noqa: F841 - kept alive on purpose
    slot = weakref.ref(ex.pager.slots[0].untyped_storage())
    ex.close()
    gc.collect()
    assert slot() is None  # its memory is free, though the engine still refers to the executor


def _tensors(held) -> list[torch.Tensor]:
    """Every tensor in a nest of lists and tuples."""
    if isinstance(held, torch.Tensor):
        return [held]
    return [t for item in held for t in _tensors(item)] if isinstance(held, (list, tuple)) else []


@pytest.mark.parametrize("r_w", [0.0, 0.5])
def test_the_pager_reads_the_experts_where_the_model_holds_them(setup, r_w):
    """The check before loading counts the weights once; the CGOPipe executor's CPU pages must then be the
    model's own expert tensors: a flat copy of the paged experts doubled their host memory (bench-1b: +1.2 GiB
    on building the executor). Counted from the tensors' storages, not from RSS."""
    model, *_ = setup
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=r_w, **EXEC_KW)
    experts = {p.untyped_storage().data_ptr() for n, p in model.named_parameters()
               if n.endswith(("mlp.gate_up_proj", "mlp.down_proj"))}
    pages = _tensors(ex.pager.cpu_pages)
    paged = sum(t.numel() * t.element_size() for t in pages)
    copies = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pages
              if t.untyped_storage().data_ptr() not in experts}
    assert paged >= ex.pager.paged_bytes * sum(ex.pager.sparse) * 0.99 > 0
    assert sum(copies.values()) == 0, f"{sum(copies.values())} bytes of experts copied beside the model's"
    ex.close()  # that paging from them gives the plain engine's run: test_tokens_and_logits_match_...


def test_budget_too_small_raises(setup):
    model, prompts, params, _ = setup
    static = static_bytes(model, 0.0)
    ex = PipelineExecutor(model, "cgopipe", "emulated", r_w=0.0, device_memory=static + 256, **EXEC_KW)
    try:
        with pytest.raises(DeviceOutOfMemory):
            run_job(model, ex, prompts[:2], params[:2], 2, 1)
        assert ex.device.memory_peak <= ex.device.memory_capacity
    finally:
        ex.close()
    with pytest.raises(DeviceOutOfMemory):  # the resident weights alone do not fit
        PipelineExecutor(model, "cgopipe", "emulated", r_w=1.0, device_memory=static, **EXEC_KW)


# Kernel launches per layer pass (one layer over one micro-batch, the pass's embedding and LM head
# spread over its layer passes): ~30 for the norms, q/k/v, rotary and the O projection, ~6 for the
# router, ~10 to sort and count the token-expert pairs on the device, ~12 per expert group (two
# grouped GEMMs, the activation, the rows' masks; a resident and a paged group), ~8 for the weighted
# sum in expert order; FlexGen's GPU attention adds ~25. The per-expert loop this replaces issued
# ~8 kernels per expert a micro-batch touches (64 for Mixtral, 1000 for a 128-expert layer).
LAUNCH_BUDGET = {"cgopipe": 100, "flexgen": 130}


@pytest.mark.parametrize("schedule", sorted(LAUNCH_BUDGET))
def test_decode_issues_no_host_sync_and_launches_as_many_kernels_for_32_experts_as_for_4(schedule):
    from dataclasses import replace

    from cpu_kernels import kernel_backend
    from moelight.models.grouped_experts import grouped_mm_supported

    kernel_backend(), grouped_mm_supported(torch.device("cpu"), torch.float32)  # one-time probes, not per pass
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(6)] for _ in range(6)]
    params = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * 6
    launches = []
    for experts in (4, 32):
        model = random_model(replace(CFG, num_experts=experts, intermediate_size=32), seed=1)
        ex = PipelineExecutor(model, schedule, "emulated", r_w=0.5, **EXEC_KW)
        try:
            run_job(model, ex, prompts, params, 6, 2, max_prefill_tokens=32)
            stats = ex.stats()
        finally:
            ex.close()
        assert stats["gpu_lane_syncs_per_step"] <= 1  # none from the compute lane: the logits' copy is the one
        launches.append(stats["launches_per_layer_pass"])
    assert launches[0] == launches[1] <= LAUNCH_BUDGET[schedule]


def test_the_packed_kv_gather_index_copies_what_the_indexed_scatter_did():
    """GPU attention's per-layer KV buffer: one index, each row's cached positions packed with a gap
    for the new token (which the GPU writes), as the old src/dst scatter laid them out."""
    from moelight.pipeline.pass_tasks import cached_slots, packed_gather_index

    cache = torch.randn(2, 300, 5)
    first, pos = torch.tensor([0, 40, 100, 220]), torch.tensor([7, 0, 31, 12])
    lengths = pos + 1
    new_off = torch.cumsum(lengths, 0) - lengths
    src = cached_slots(first, pos)
    assert src.tolist() == [s for f, p in zip(first.tolist(), pos.tolist(), strict=True) for s in range(f, f + p)]
    index = packed_gather_index(src, pos)
    expected = torch.zeros(2, int(lengths.sum()), 5)
    expected[:, cached_slots(new_off, pos)] = cache[:, src]
    got = cache[:, index]
    gaps = (new_off + pos).tolist()  # the new tokens' rows: written on the GPU afterwards
    keep = [r for r in range(len(index)) if r not in gaps]
    assert torch.equal(got[:, keep], expected[:, keep])
