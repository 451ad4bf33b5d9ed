"""The planner and the memory check before loading count a CPU job's memory alike, so the batch the planner
picks is one the check accepts on the same host figures, and the largest such (benchmarks/results/
memory_planner_check.md). The planner once counted the KV cache as every sequence's mean context less its
shared prefix, the check the pool the engine reserves (then the largest sequences, unshared): on Qwen3-30B-A3B
int4 with 640 requests the planner picked 444 and the session capped it to 139. Both now read the pool from
runtime/paged_layout.pool_table, which counts each shared prefix once per distinct prefix live at once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hrm import hardware_presets
from moelight.engine import session as session_module
from moelight.engine.options import EngineOptions
from moelight.engine.session import EngineSession
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.presets import PRESETS
from moelight.planning.memory_check import OutOfMemoryPlan, check_fits, run_sizes
from moelight.sampling.params import SamplingParams

GIB = 2**30


def _prompts(distinct: int, requests: int) -> list[list[int]]:
    """`distinct` prompts of 40-130 tokens, cycled to `requests` (a replicated dataset: repeats share their
    pages under prefix sharing)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, 1000, (40 + (90 * i) // max(1, distinct - 1),), generator=g).tolist()
            for i in range(distinct)]
    return [base[i % distinct] for i in range(requests)]


def _session(sharing: bool, hardware: str) -> EngineSession:
    """A planning-only session of Qwen3-30B-A3B with int4 experts on the CPU (nothing resolved or loaded)."""
    s = object.__new__(EngineSession)
    s.opts = EngineOptions(model="qwen3-30b-a3b", hardware=hardware, quantize="int4",
                           enable_prefix_caching=sharing)
    s.config = with_expert_format(PRESETS["qwen3-30b-a3b"], torch.bfloat16, "cpu", "int4")
    s.source = type("Source", (), {"dtype": torch.bfloat16})()
    s.dtype_name, s.device, s.ranks, s.log, s.model, s.plain_weights = "bfloat16", "cpu", 1, None, None, True
    s.plain_allowed = True
    return s


@pytest.mark.parametrize("sharing, distinct, sampling", [(True, 16, {"temperature": 0.0}),
                                                         (False, 640, {"temperature": 1.0, "top_p": 0.9})])
@pytest.mark.parametrize("available_gib", [21.5, 22.9])
def test_the_planners_batch_is_the_checks_on_the_same_host(tmp_path, monkeypatch, sharing, distinct, sampling,
                                                           available_gib, bf16_packing_host):
    """640 requests of 8 new tokens: a replicated dataset with prefix sharing (most prompt tokens shared) and
    greedy sampling, and distinct prompts without sharing, sampled with top-p. The host declares
    `available_gib` and the process holds nothing beside the model, so the planner and the check have the same
    memory: the plan is not capped, its batch passes the check and a batch a tenth larger does not (the planner
    leaves nothing on the table)."""
    available = int(available_gib * GIB)
    hw = hardware_presets.get_hardware("cpu-server")
    path = replace(hw, cpu=replace(hw.cpu, memory_bytes=available)).save(tmp_path / "host.json")
    monkeypatch.setattr(session_module, "available_bytes", lambda: available)
    monkeypatch.setattr(session_module, "held_before_job", lambda loaded: 0)
    s = _session(sharing, str(path))
    prompts = _prompts(distinct, 640)
    params = [SamplingParams(max_tokens=8, **sampling)] * len(prompts)
    plan = s.plan(prompts, params)
    assert plan.workload.argmax_only == (sampling["temperature"] == 0)
    assert "batch_capped" not in plan.info
    assert 8 < plan.batch_size < len(prompts)  # memory bounds it

    def check(batch: int) -> dict:
        sizes = run_sizes(plan.workload, len(prompts), batch, batch)
        return check_fits(s.config, torch.bfloat16, available=available, on_cpu=True, plain_weights=False, **sizes)

    check(plan.batch_size)
    with pytest.raises(OutOfMemoryPlan):
        check(int(plan.batch_size * 1.1) + 1)


@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("batch", [3, 8, 20])
@pytest.mark.parametrize("workload", ["prefix", "samples"])
def test_the_kv_term_is_the_pool_the_engine_allocates(monkeypatch, sharing, batch, workload):
    """The pool a generation allocates (its token slots and bytes) is the one the plan's workload and the
    check count for that batch: the largest sequences' rooms, in whole pages where it pages, and with prefix
    sharing each shared prefix once per distinct prefix live at once (24 prompts behind a 40-token prefix, or
    6 prompts of 4 samples each), smaller than the unshared pool where the batch must share."""
    import math

    from moelight.engine import generation
    from moelight.engine.generation import Engine
    from moelight.loading.weights import build_model
    from moelight.planning.job_plan import workload_of
    from moelight.planning.memory_check import kv_bytes
    from moelight.runtime.paged_layout import reserved_rooms

    cfg = PRESETS["tiny"]
    model = build_model(cfg, torch.float32, None, seed=0)
    g = torch.Generator().manual_seed(batch)
    prefix = torch.randint(3, cfg.vocab_size, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, cfg.vocab_size, (1 + 7 * i % 23,), generator=g).tolist() for i in range(24)]
    if workload == "samples":
        prompts = [prompts[i // 4][len(prefix) - 8 * (i // 4):] for i in range(24)]  # distinct prompts, 4 each
    params = [SamplingParams(max_tokens=1 + i % 5, ignore_eos=True) for i in range(24)]
    pools = []
    cls = generation.kv_cache_class(cfg)
    allocate = cls.pool

    def recorded(*a, **k):
        pools.append(allocate(*a, **k))
        return pools[-1]

    monkeypatch.setattr(cls, "pool", recorded)
    Engine(model, (cfg.eos_token_ids[0],), prefix_sharing=sharing).generate(prompts, params, list(range(24)),
                                                                              batch, batch)
    slots = pools[0].k[0].shape[1]
    counted = math.ceil(workload_of(prompts, params, 4096, sharing).pool_tokens(batch))
    assert slots == counted
    held = sum(t.nbytes for t in (*pools[0].k, *pools[0].v))
    assert held == kv_bytes(cfg, counted, torch.float32)
    rooms = [len(p) + q.max_tokens for p, q in zip(prompts, params, strict=True)]
    unshared = sum(reserved_rooms(rooms, True)[:batch])
    if sharing and (workload == "prefix" or batch > 6):  # 3 of 6 distinct prompts' samples may share nothing
        assert slots < unshared
    else:
        assert slots == (unshared if sharing else sum(sorted(rooms, reverse=True)[:batch]))
